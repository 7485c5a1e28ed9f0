"""Log shipping is at-least-once across agent restarts on a busy machine, on both runtimes.

An app writes numbered lines without end while a real agent process (``python -m services.agent``) ships
them; the agent is stopped (SIGTERM) and killed (SIGKILL) in turn, round after round, with every core
saturated by a CPU hog the test started, and the app writes on while no agent runs. Each new agent adopts
the same process (same pid) or container and ships from the saved cursors (the output files' offsets; for a
container also where its output was copied up to): every number the app wrote must reach the stream.
``make test`` runs a few rounds per runtime, ``make chaos`` twenty.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import aiodocker
import psutil
import pytest
from nats.aio.msg import Msg

from services.agent.logs import STREAM_FILES
from services.agent.processes import InstanceRecord
from shared.applogs import STDOUT, LogLimits, app_log_subject, app_logs_stream_config, lines_of
from shared.connection import Connection
from shared.provisioning import create_or_update_stream
from shared.txn import Writer
from tests.agent.conftest import assignment, process_ref, release
from tests.cpuhog import cpu_hog
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
ENV = "E1"
AGENT_ENV = {
    "ZATTERA_AGENT_RUNTIME": "process",
    "ZATTERA_AGENT_HEARTBEAT_INTERVAL": "0.5",
    "ZATTERA_AGENT_RECONCILE_TICK": "1",
    "ZATTERA_AGENT_REPORT_RETRY": "0.1",
    "PYTHONUNBUFFERED": "1",
}
WRITER = """
import itertools, sys, time
for i in itertools.count():
    print(f"out {i}", flush=True)
    time.sleep(0.001)
"""
ROUND_TIMEOUT = 120.0
"""An agent's start (interpreter, imports, registration) on a machine whose cores are all taken."""


class Shipped:
    """Every stdout number the env's stream holds, followed live from the start of the stream."""

    def __init__(self) -> None:
        self.numbers: set[int] = set()

    async def follow(self, conn: Connection) -> None:
        async def on_batch(msg: Msg) -> None:
            for line in lines_of(msg.data):
                if line.stream == STDOUT:
                    self.numbers.add(int(line.line.split()[1]))

        await conn.js.subscribe(app_log_subject(ENV), ordered_consumer=True, cb=on_batch)

    def gaps(self) -> list[int]:
        top = max(self.numbers, default=-1)
        return sorted(set(range(top + 1)) - self.numbers)


def lines_in_file(path: Path) -> int:
    """Lines the app has written so far (shipped bytes punched out of the file read as zeros)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@dataclass
class App:
    """The writing app on one runtime: its image ref, how many lines it has written, what identifies it."""

    runtime: str
    docker_host: str = ""
    instance: Path = Path()

    def ref(self, directory: Path) -> str:
        if self.runtime == "docker":
            loop = 'i=0; while :; do echo "out $i"; i=$((i+1)); [ $((i % 10)) -eq 0 ] && sleep 0.01; done'
            return "exec:" + quote(loop, safe="")
        (directory / "writer.py").write_text(WRITER)
        return process_ref(directory, f"{sys.executable} writer.py")

    def identity(self) -> str:
        record = InstanceRecord.load(self.instance)
        assert record is not None
        return record.container_id or str(record.pid)

    async def written(self) -> int:
        """Lines written so far: the output file of a process; the daemon's log of a container (its file is
        filled by the agent's follower, which is down with the agent)."""
        if self.runtime != "docker":
            return lines_in_file(self.instance / STREAM_FILES[STDOUT])
        docker = aiodocker.Docker(url=self.docker_host)
        try:
            container = await docker.containers.get(self.identity())
            return len(await container.log(stdout=True))
        finally:
            await docker.close()

    async def kill(self) -> None:
        record = InstanceRecord.load(self.instance)
        if record is None:
            return
        if self.runtime == "docker" and record.container_id:
            docker = aiodocker.Docker(url=self.docker_host)
            try:
                with contextlib.suppress(aiodocker.DockerError):
                    await (await docker.containers.get(record.container_id)).delete(force=True)
            finally:
                await docker.close()
        elif record.pid:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                os.killpg(record.pid, signal.SIGKILL)


def start_agent(nats_url: str, data_dir: Path, log: Path, app: App) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "services.agent", "--nats", nats_url, "--node-id", "n1", "--data-dir", str(data_dir)]
    env = {
        **os.environ,
        **AGENT_ENV,
        "ZATTERA_AGENT_RUNTIME": app.runtime,
        "ZATTERA_AGENT_DOCKER_HOST": app.docker_host,
    }
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


async def stop(agent: subprocess.Popen[bytes], how: signal.Signals) -> None:
    agent.send_signal(how)
    code = await asyncio.to_thread(agent.wait, 60)
    assert how == signal.SIGKILL or code == 0, f"the agent exited {code} on {how.name}"


@pytest.fixture(params=["process", "docker"])
def app(request: pytest.FixtureRequest) -> App:
    """The app on each runtime (the docker one on the session's private daemon)."""
    if request.param == "docker":
        return App("docker", request.getfixturevalue("docker_host"))
    return App("process")


@pytest.mark.parametrize(
    "rounds", [pytest.param(3, id="3-rounds"), pytest.param(20, id="20-rounds", marks=pytest.mark.chaos)]
)
@pytest.mark.timeout(1500)
async def test_agent_stops_and_kills_under_cpu_pressure_lose_no_line(
    conn: Connection, writer: Writer, nats_url: str, tmp_path: Path, rounds: int, app: App
) -> None:
    await create_or_update_stream(conn.js, app_logs_stream_config(ENV, LogLimits(256 * 1024 * 1024, 3600.0), 1))
    shipped = Shipped()
    await shipped.follow(conn)
    rel = release(app.ref(tmp_path), env_id=ENV, healthcheck=False)
    a = assignment("n1", rel)
    await writer.commit(writer.txn("seed").put(rel).put(a))
    data_dir = tmp_path / "agent-n1"
    app.instance = data_dir / "instances" / a.meta.id
    log = tmp_path / "agent.log"
    identity = ""
    agent: subprocess.Popen[bytes] | None = None
    try:
        with cpu_hog():
            before = 0
            for i in range(rounds):
                agent = start_agent(nats_url, data_dir, log, app)
                await eventually(
                    lambda before=before: len(shipped.numbers) > before + 20,
                    ROUND_TIMEOUT,
                    f"round {i}: what was written while no agent ran, and more, shipped",
                )
                identity = identity or app.identity()
                assert app.identity() == identity, f"round {i}: the app was restarted, not adopted"
                how = signal.SIGTERM if i % 2 == 0 else signal.SIGKILL
                await stop(agent, how)
                agent = None
                down_at = await app.written()

                async def wrote_on(down_at: int = down_at) -> bool:
                    return await app.written() > down_at + 50

                await eventually(wrote_on, 30, f"round {i}: the app writes on")
                before = await app.written()
            agent = start_agent(nats_url, data_dir, log, app)
            await eventually(lambda: len(shipped.numbers) > before, ROUND_TIMEOUT, "the last backlog shipped")
        assert app.identity() == identity
        assert shipped.gaps() == [], f"lines never shipped: {shipped.gaps()[:20]} (agent log: {log})"
        assert max(shipped.numbers) >= before
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        await app.kill()
