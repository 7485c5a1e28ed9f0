"""Jobs end to end on a real NATS server: a real agent runs the job assignment once, the jobs loop (fake
clock, under its lease) records the outcome, and ``zattera run`` (a real process) prints the command's
output and exits with its exit code; Ctrl-C cancels the job (docs/jobs.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.scheduler.jobs import JobsLoop
from shared import jobs as J
from shared import keys as K
from shared.applogs import LogLimits, app_logs_stream_config
from shared.clock import FakeClock
from shared.connection import Connection
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.provisioning import create_or_update_stream
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, process_ref, release
from tests.cli.test_builds_logs import REPO_ROOT, zattera_command
from tests.factories import env as make_env
from tests.waiting import eventually

TIMEOUT = 30.0


@pytest.fixture
async def cluster(
    conn: Connection, view: StateView, writer: Writer, start_agent: StartAgent, tmp_path: Path
) -> AsyncIterator[pb.Environment]:
    """Env E1 with an active release, a real agent on n1, and the jobs loop leading."""
    rel = release(process_ref(workdir(tmp_path), f"{sys.executable} -c pass"), healthcheck=False)
    env = make_env("E1", project_id="P1", app_id="A1", min_replicas=0, active_release_id=rel.meta.id)
    await writer.commit(writer.txn().put(env).put(rel))
    await create_or_update_stream(conn.js, app_logs_stream_config("E1", LogLimits(1 << 24, 3600.0), 1))
    await start_agent("n1")
    await eventually(lambda: view.node("n1") is not None, what="node registered")
    loop = JobsLoop(LoopDeps(conn, view, FakeClock()))
    leading = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="t", ttl=3, renew_interval=0.5))
    try:
        yield env
    finally:
        leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)


def workdir(tmp_path: Path) -> Path:
    """The jobs' ``process://`` directory, writable by the env's user they run as when sandboxed."""
    directory = tmp_path / "work"
    directory.mkdir(exist_ok=True)
    return directory


def job_of(view: StateView, job_id: str) -> pb.Job:
    job = view.get(K.JOB, job_id)
    assert isinstance(job, pb.Job)
    return job


async def zattera(nats_url: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *zattera_command(),
        "--nats",
        nats_url,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
    )


async def test_a_job_assignment_runs_once_and_its_outcome_is_recorded(
    cluster: pb.Environment, view: StateView, writer: Writer
) -> None:
    job = J.one_off_job(cluster, "echo first; echo second; echo oops >&2; exit 4", now=time.time())
    await writer.commit(writer.txn().create(job))
    await eventually(lambda: job_of(view, job.meta.id).status == J.FAILED, timeout=TIMEOUT, what="job ended")
    done = job_of(view, job.meta.id)
    assert (done.exit_code_known, done.exit_code, done.attempt) == (True, 4, 1)
    assert list(done.output_tail) == ["first", "second", "oops"]
    assert done.started_at.seconds > 0 and done.finished_at.seconds > 0
    await eventually(lambda: view.assignment(done.assignment_id) is None, timeout=TIMEOUT, what="assignment reaped")


async def test_zattera_run_prints_the_output_and_exits_with_the_command_exit_code(
    cluster: pb.Environment, nats_url: str
) -> None:
    script = "import sys; print('hello from the job'); sys.exit(3)"
    proc = await zattera(nats_url, "run", "--env", "E1", "--", sys.executable, "-c", script)
    out, errors = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode == 3, errors.decode()
    assert out.decode().splitlines() == ["hello from the job"]


async def test_ctrl_c_cancels_the_job(cluster: pb.Environment, nats_url: str, view: StateView) -> None:
    proc = await zattera(nats_url, "run", "--env", "E1", "--", "echo started; exec sleep 60")
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), TIMEOUT) == b"started\n"
        proc.send_signal(signal.SIGINT)
        _, errors = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        assert proc.returncode == 130, errors.decode()
        [job] = view.jobs("E1")
        assert (job.status, job.cancel_requested) == (J.CANCELED, True)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def test_an_ended_job_is_not_run_again_by_a_restarted_agent(
    start_agent: StartAgent, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    """No jobs loop here: the ended job's assignment stays, as when the control plane is down."""
    rel = release(process_ref(workdir(tmp_path), f"{sys.executable} -c pass"), healthcheck=False)
    a = assignment("n1", rel)
    a.job_id, a.job_command = "J1", f"echo ran >> {workdir(tmp_path) / 'runs'}"
    await writer.commit(writer.txn().put(rel).put(a))
    data_dir = tmp_path / "agent-n1"
    first = await start_agent("n1", data_dir=data_dir)

    def ended() -> bool:
        found = view.assignment(a.meta.id)
        return found is not None and found.observed.state == pb.INSTANCE_STATE_STOPPED

    await eventually(ended, timeout=TIMEOUT, what="job ended")
    await first.stop()
    second = await start_agent("n1", data_dir=data_dir)
    runtime = second.agent.runtime
    assert runtime is not None

    def parked() -> bool:
        supervisor = runtime.supervisor(a.meta.id)
        return supervisor is not None and supervisor.parked

    await eventually(parked, timeout=TIMEOUT, what="the restarted agent parked the ended job")
    assert (workdir(tmp_path) / "runs").read_text() == "ran\n"
