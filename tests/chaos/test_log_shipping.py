"""Log shipping is at-least-once across agent restarts on a busy machine, on both runtimes.

An app writes numbered lines without end while a real agent process (``python -m services.agent``) ships
them; the agent is stopped (SIGTERM) and killed (SIGKILL) in turn, round after round, with every core
saturated by a CPU hog the test started, and the app writes on while no agent runs. Each new agent adopts
the same process (same pid) or container and ships from the saved cursors (the output files' offsets; for a
container also where its output was copied up to): every number the app wrote must reach the stream.
``make test`` runs a few rounds per runtime, ``make chaos`` twenty.

How far the app has written is the number of its last line, which only grows: not a count of lines kept
somewhere, which shrinks when the agent gives shipped bytes back (hole punching) or the daemon rotates the
container's log away. An agent is signalled only once it has shipped a line written after its predecessor
stopped: it runs its body then, so its signal handlers are in place.
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

from services.agent.docker_containers import container_config
from services.agent.docker_images import ContainerImage
from services.agent.launchers import LaunchPlan
from services.agent.logs import STREAM_FILES, punch_hole
from services.agent.processes import InstanceRecord
from shared.applogs import STDOUT, LogLimits, app_log_subject, app_logs_stream_config, lines_of
from shared.connection import Connection
from shared.provisioning import create_or_update_stream
from shared.txn import Writer
from tests.agent.conftest import assignment, process_ref, release
from tests.cpuhog import cpu_hog
from tests.dockerd import BASE_IMAGE
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


def number_of(line: str | bytes) -> int:
    """The number an app's line ``out <n>`` carries."""
    text = line.decode() if isinstance(line, bytes) else line
    return int(text.split()[1])


def last_number_in_file(path: Path) -> int:
    """The number of the last complete line of an output file (-1: none yet). Read from the file's end: the
    agent punches shipped bytes out of its start (they read as zeros), never its newest ones."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 4096))
            tail = f.read()
    except FileNotFoundError:
        return -1
    complete = [line for line in tail[: tail.rfind(b"\n") + 1].split(b"\n") if line.startswith(b"out ")]
    return number_of(complete[-1]) if complete else -1


async def last_number_in_container(docker_host: str, container_id: str) -> int:
    """The number of the last line of a container's output the daemon keeps (-1: none yet)."""
    docker = aiodocker.Docker(url=docker_host)
    try:
        container = await docker.containers.get(container_id)
        tail = await container.log(stdout=True, tail=1)
        return number_of(tail[-1]) if tail else -1
    finally:
        await docker.close()


@dataclass
class App:
    """The writing app on one runtime: its image ref, how far it has written, what identifies it."""

    runtime: str
    docker_host: str = ""
    instance: Path = Path()
    seen: int = -1
    """The highest number :meth:`written` returned so far."""

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
        """The number of the last line written so far: the end of a process's output file; the daemon's last
        line of a container (the output file is filled by the agent's follower, which is down with the
        agent). It never goes back: a measure that did would make the rounds' conditions vacuous."""
        if self.runtime != "docker":
            last = last_number_in_file(self.instance / STREAM_FILES[STDOUT])
        else:
            last = await last_number_in_container(self.docker_host, self.identity())
        assert last >= self.seen, f"the app's last line went back from {self.seen} to {last}"
        self.seen = last
        return last

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
            before = -1
            for i in range(rounds):
                agent = start_agent(nats_url, data_dir, log, app)
                # A line written after the last agent stopped (> before) is shipped by this one only: it runs.
                await eventually(
                    lambda before=before: max(shipped.numbers, default=-1) > before + 20,
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
            await eventually(
                lambda: max(shipped.numbers, default=-1) > before, ROUND_TIMEOUT, "the last backlog shipped"
            )
        assert app.identity() == identity
        assert shipped.gaps() == [], f"lines never shipped: {shipped.gaps()[:20]} (agent log: {log})"
        assert max(shipped.numbers) >= before
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        await app.kill()


def test_how_far_a_process_wrote_survives_the_agent_giving_shipped_bytes_back(tmp_path: Path) -> None:
    """The agent punches shipped bytes out of an output file (they read as zeros): a count of the file's
    lines shrinks then (a round's condition measured so held at once, and the agent was signalled before
    it had installed its handlers); the number of the last line stays."""
    path = tmp_path / "stdout.log"
    path.write_bytes(b"".join(b"out %d\n" % i for i in range(300_000)) + b"out 300")
    lines = path.read_bytes().count(b"\n")
    fd = os.open(path, os.O_RDWR)
    try:
        assert punch_hole(fd, 2 * 1024 * 1024), "hole punching unsupported here"
    finally:
        os.close(fd)
    assert path.read_bytes().count(b"\n") < lines - 100_000
    assert last_number_in_file(path) == 299_999  # the unterminated last line is not complete yet
    assert last_number_in_file(tmp_path / "missing.log") == -1


@pytest.mark.chaos
async def test_how_far_a_container_wrote_survives_the_daemon_rotating_its_log(docker_host: str) -> None:
    """The daemon keeps a container's output in two json-file files of 10 MB (the agent's log config): past
    them it drops the older one, so the count of lines it returns falls by half (in the 20-round docker
    variant about round 18: "the app writes on" was never met, or the next round's condition held before
    the agent ran); the number of the last line only grows."""
    flood = 'i=0; while :; do echo "out $i"; i=$((i+1)); done'
    image = ContainerImage("exec:", Path("/"), tag=BASE_IMAGE)
    config = container_config(["/bin/sh", "-c", flood], image=image, env={}, plan=LaunchPlan(), labels={}, pids_limit=0)
    docker = aiodocker.Docker(url=docker_host)
    container = await docker.containers.create(config)
    try:
        await container.start()
        seen = -1

        async def past_two_rotations() -> bool:
            nonlocal seen
            last = await last_number_in_container(docker_host, container.id)
            assert last >= seen, f"the last line went back from {seen} to {last}"
            seen = last
            return last > 300_000

        await eventually(past_two_rotations, 300, "the container wrote 300k lines")
        kept = len(await container.log(stdout=True))
        assert kept < seen - 100_000, f"the daemon kept {kept} of {seen} lines: no rotation dropped any"
        assert await last_number_in_container(docker_host, container.id) >= seen
    finally:
        with contextlib.suppress(aiodocker.DockerError):
            await container.delete(force=True)
        await docker.close()
