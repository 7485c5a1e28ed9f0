"""A running control plane for bad-input properties: one nats-server, every service as a process (an agent
with its builder, and the join service with a key set made by ``shared.security.setup.prepare``), plus
in-process observers (StateView, LiveView, RouteClient) on a background event loop, so hypothesis'
synchronous ``@given`` tests can drive real NATS I/O example by example.

Everything the agent may touch lives under the rig's temporary directory: ``agent_dir`` (its data dir),
``volumes_dir`` (``<agent_dir>/volumes``) and ``builds_dir`` (``<agent_dir>/builds``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.live import LiveView
from shared.provisioning import provision
from shared.routeclient import RouteClient
from shared.security.setup import prepare
from shared.state.feed import StateView
from shared.txn import Writer

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler", "orchestrator", "autoscale", "builds", "routes", "join")
AGENT_NODE = "bad-node"
PROGRESS_DONE = ("done", "error")
T = TypeVar("T")


class Rig:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.server = EmbeddedNats(data_dir=base / "nats")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="badinput-loop", daemon=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conn: Connection
        self.view: StateView
        self.live: LiveView
        self.routes: RouteClient
        self.writer: Writer
        self.agent_dir = base / "agent"
        self.volumes_dir = self.agent_dir / "volumes"
        self.builds_dir = self.agent_dir / "builds"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> Rig:
        self.server.start()
        self.thread.start()
        self.run(self._start_clients())
        prepare(self.base / "data" / "security")  # the join service's keys (it answers without a secured server)
        env = {
            **os.environ,
            "ZATTERA_NATS_URL": self.server.url,
            "ZATTERA_LOOP_TICK": "1",
            "ZATTERA_LEASE_TTL": "1",
            "ZATTERA_LEASE_RENEW": "0.3",
            "ZATTERA_DOMAIN": "bad.test",
            "ZATTERA_AGENT_DATA_DIR": str(self.agent_dir),
            "ZATTERA_DATA_DIR": str(self.base / "data"),
            "PYTHONUNBUFFERED": "1",
        }
        argvs = {name: ["-m", f"services.{name}"] for name in SERVICES}
        argvs["agent"] = ["-m", "services.agent", "--node-id", AGENT_NODE, "--data-dir", str(self.agent_dir)]
        argvs["agent"].append("--builder")
        for name, argv in argvs.items():
            with open(self.base / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, *argv, "--nats", self.server.url],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        self.run(self._ready(), 90)
        return self

    async def _ready(self) -> None:
        """Every responder answers and the agent heartbeats before any garbage is sent."""
        from shared.security.permissions import JOIN_ISSUE_SUBJECT
        from shared.subjects import ACTIVATE_SUBJECT, ROUTES_GET_SUBJECT, agent_subject
        from tests.waiting import eventually

        async def answers(subject: str, body: bytes) -> bool:
            try:
                await self.conn.nc.request(subject, body, timeout=1.0)
                return True
            except Exception:
                return False

        await eventually(lambda: answers(ROUTES_GET_SUBJECT, b""), 60, "routes.get answered")
        await eventually(lambda: answers(ACTIVATE_SUBJECT, cpb.ActivateRequest().SerializeToString()), 60, "activate")
        await eventually(lambda: self.live.node_heartbeat(AGENT_NODE) is not None, 60, "the agent's heartbeat")
        await eventually(lambda: answers(JOIN_ISSUE_SUBJECT, b"{}"), 60, "join.issue answered")
        prune = cpb.PruneSnapshotsRequest(target=cpb.SnapshotTarget(prefix="ready/")).SerializeToString()
        await eventually(lambda: answers(agent_subject(AGENT_NODE, "prune"), prune), 60, "the snapshot handlers")
        await eventually(lambda: answers(agent_subject(AGENT_NODE, "build.cancel"), b""), 60, "the agent's builder")
        await eventually(lambda: all(self.view.lease(n) is not None for n in ("scheduler", "orchestrator")), 60)

    async def _start_clients(self) -> None:
        self.conn = await connect(self.server.url, name="badinput")
        await provision(self.conn.js)
        self.view = StateView(self.conn, name="badinput")
        await self.view.start()
        self.writer = Writer(self.conn, self.view)
        self.live = LiveView(self.conn, RealClock())
        await self.live.start()
        self.routes = RouteClient(self.base / "routes.cache", request_timeout=1.0)
        await self.routes.start(self.conn)

    async def ask(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None = None, *, timeout: float = 10.0
    ) -> Msg:
        """One request, one reply (``nc.request``, with the headers as given)."""
        return await self.conn.nc.request(subject, data, timeout=timeout, headers=dict(headers) if headers else None)

    async def progress(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None = None, *, timeout: float = 15.0
    ) -> list[cpb.SnapshotProgress]:
        """A snapshot or restore request and its progress stream, up to the ``done`` or ``error`` message."""
        nc = self.conn.nc
        inbox = nc.new_inbox()
        received: list[cpb.SnapshotProgress] = []
        finished = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            received.append(cpb.SnapshotProgress.FromString(msg.data))
            if received[-1].phase in PROGRESS_DONE:
                finished.set()

        sub = await nc.subscribe(inbox, cb=on_msg)
        try:
            await nc.publish(subject, data, reply=inbox, headers=dict(headers) if headers else None)
            await asyncio.wait_for(finished.wait(), timeout)
        finally:
            await sub.unsubscribe()
        return received

    def log(self, name: str) -> str:
        return (self.base / f"{name}.log").read_text(errors="replace")

    def dead(self) -> dict[str, str]:
        return {n: self.log(n)[-3000:] for n, p in self.procs.items() if p.poll() is not None}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

        async def close() -> None:
            await self.routes.stop()
            await self.live.stop()
            await self.view.stop()
            await self.conn.close()

        try:
            self.run(close(), 15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.server.stop()
