"""Fixtures for the agent tests: agents running in-process against a real NATS server, real processes.

The "app" is a tiny Python HTTP server written into the test's directory and run through a
``process://`` image ref (no build needed). Every timer is shortened through ``AgentSettings``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.agent import Agent
from services.agent.settings import AgentSettings
from shared.clock import Clock
from shared.connection import Connection, connect
from shared.ids import new_id
from tests.waiting import eventually

FAST: dict[str, object] = {
    "heartbeat_interval": 0.3,
    "reconcile_tick": 1.0,
    "report_retry": 0.1,
    "restart_backoff": 0.05,
    "restart_backoff_max": 0.2,
    "stable_after": 5.0,
    "default_stop_grace": 3.0,
    "startup_probe_interval": 0.05,
    "min_healthy_time": 0.5,
    "adopted_poll_interval": 0.1,
    "stop_on_exit": True,
}

APP = """
import http.server, os, pathlib, signal

ASSIGNMENT = os.environ["ZATTERA_ASSIGNMENT_ID"]


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from {ASSIGNMENT}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def on_sigterm(*_):
    pathlib.Path(f"sigterm-{ASSIGNMENT}").write_text("SIGTERM")
    os._exit(0)


signal.signal(signal.SIGTERM, on_sigterm)
volume = os.environ.get("ZATTERA_VOLUME_DATA")
if volume:
    pathlib.Path(volume, "written-by-app").write_text(ASSIGNMENT)
http.server.HTTPServer((os.environ["ZATTERA_BIND_ADDR"], int(os.environ["PORT"])), Handler).serve_forever()
"""


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """The app's directory; writable by every user: sandboxed, the app runs as its environment's user and
    writes its SIGTERM marker there (a ``process://`` image's directory is bound as it is)."""
    directory = tmp_path / "app"
    directory.mkdir()
    directory.chmod(0o777)
    (directory / "app.py").write_text(APP)
    return directory


def process_ref(directory: Path, command: str) -> str:
    """A ``process://`` image running ``command`` in ``directory``, which its app may read and write: sandboxed,
    the app runs as its environment's user, not the test's (pytest's directories are 0700)."""
    directory.chmod(0o777)
    return f"process://{directory}?cmd={quote(command, safe='')}"


def app_ref(app_dir: Path) -> str:
    return process_ref(app_dir, f"{sys.executable} app.py")


def release(image_ref: str, *, env_id: str = "E1", healthcheck: bool = True, stop_grace: float = 0.0) -> pb.Release:
    r = pb.Release(environment_id=env_id, project_id="P1", app_id="A1", version=1, image_ref=image_ref)
    r.meta.id = new_id()
    r.config_hash = "cfg-1"
    if healthcheck:
        check = r.service.healthcheck
        check.type = pb.HEALTH_CHECK_TYPE_HTTP
        check.path = "/health"
        check.interval.FromMilliseconds(200)
        check.timeout.FromMilliseconds(1000)
        check.grace_period.FromSeconds(5)
        check.unhealthy_threshold = 2
    if stop_grace:
        r.service.stop_grace.FromMilliseconds(int(stop_grace * 1000))
    return r


def assignment(node_id: str, rel: pb.Release, *, desired: int = pb.ASSIGNMENT_DESIRED_RUN) -> pb.Assignment:
    a = pb.Assignment(
        node_id=node_id,
        project_id=rel.project_id,
        app_id=rel.app_id,
        environment_id=rel.environment_id,
        release_id=rel.meta.id,
        config_hash=rel.config_hash,
        desired=desired,  # type: ignore[arg-type]
    )
    a.meta.id = new_id()
    return a


@dataclass
class RunningAgent:
    agent: Agent
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.agent.conn.close()


StartAgent = Callable[..., Awaitable[RunningAgent]]


def _kill_instances_under(root: Path) -> None:
    """Safety net: no instance outlives its test (instances carry ZATTERA_ASSIGNMENT_ID and run under root;
    a sandboxed one's processes below its bwrap too, which would outlive bwrap's own death)."""
    for proc in psutil.process_iter(["cwd"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["cwd"] or "").startswith(str(root)) and "ZATTERA_ASSIGNMENT_ID" in proc.environ():
                for member in [*proc.children(recursive=True), proc]:
                    with contextlib.suppress(psutil.Error):
                        member.kill()


@pytest.fixture
async def start_agent(conn: Connection, nats_url: str, tmp_path: Path) -> AsyncIterator[StartAgent]:
    """Start agents, each on its own connection as a real agent process would be."""
    running: list[RunningAgent] = []

    async def start(
        node_id: str = "n1", *, data_dir: Path | None = None, clock: Clock | None = None, **overrides: object
    ) -> RunningAgent:
        settings = AgentSettings(node_id=node_id, **{**FAST, **overrides})  # type: ignore[arg-type]
        agent_conn = await connect(nats_url, name=f"agent-{node_id}")
        agent = Agent(agent_conn, settings, data_dir or tmp_path / f"agent-{node_id}", clock=clock)
        handle = RunningAgent(agent, asyncio.create_task(agent.run()))
        running.append(handle)
        await eventually(lambda: agent.runtime is not None, what="agent registered")
        return handle

    try:
        yield start
    finally:
        for handle in reversed(running):
            await handle.stop()
        _kill_instances_under(tmp_path)
