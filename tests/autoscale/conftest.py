"""Fixtures for the scaling tests: a fake clock, a LiveView on the real ``zattera-live`` bucket, and a
harness that seeds state, publishes heartbeats and hands out loops whose writer is fenced by a lease
held for the test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest
from google.protobuf.message import Message
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.autoscale.common import ScalingLoop
from shared.clock import FakeClock
from shared.connection import Connection
from shared.lease import Leadership, Lease
from shared.live import LiveView, publish_node_heartbeat, publish_proxy_heartbeat
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Txn, TxnError, Writer
from tests.waiting import eventually

L = TypeVar("L", bound=ScalingLoop)


class InterleavingWriter(Writer):
    """A writer that lets someone else write first, once: between a decision and its commit."""

    def __init__(self, *args: Any, before_commit: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._before: Callable[[], Awaitable[None]] | None = before_commit

    async def _interleave(self) -> None:
        if self._before is not None:
            before, self._before = self._before, None
            await before()

    async def commit(self, txn: Txn) -> None:
        await self._interleave()
        await super().commit(txn)

    async def commit_many(self, txns: Sequence[Txn]) -> list[TxnError | None]:
        await self._interleave()
        return await super().commit_many(txns)


class Harness:
    def __init__(self, conn: Connection, view: StateView, writer: Writer, live: LiveView, clock: FakeClock) -> None:
        self.conn = conn
        self.view = view
        self.writer = writer
        self.live = live
        self.clock = clock

    async def seed(self, *msgs: Message) -> None:
        txn = self.writer.txn()
        for msg in msgs:
            txn.put(msg)
        await self.writer.commit(txn)

    def env(self, env_id: str = "env1") -> pb.Environment:
        env = self.view.env(env_id)
        assert env is not None
        return env

    async def edit_env(self, env: pb.Environment) -> None:
        """An operator's edit of the env (an unfenced write from outside the loops)."""
        await self.writer.commit(self.writer.txn().put(env))

    async def beat(self, hb: cpb.Heartbeat | cpb.ProxyHeartbeat) -> None:
        """Publish a heartbeat to zattera-live and wait until the LiveView holds it."""
        if isinstance(hb, cpb.Heartbeat):
            await publish_node_heartbeat(self.conn, hb)
            await eventually(lambda: self.live.node_heartbeat(hb.node_id) == hb, what="node heartbeat seen")
        else:
            await publish_proxy_heartbeat(self.conn, hb)
            await eventually(lambda: hb in self.live.fresh_proxy_heartbeats(), what="proxy heartbeat seen")

    async def tick(self, loop: ScalingLoop, seconds: float) -> None:
        """Advance the clock and wait until the running loop has made a pass and parked again."""
        before = loop.passes
        await self.clock.advance(seconds)
        await eventually(lambda: loop.passes > before and self.clock.sleepers > 0, what=f"{loop.name} ticked")

    async def started(self, loop: ScalingLoop) -> None:
        """Wait until a running loop has made its term-start pass and parked on its tick."""
        await eventually(lambda: loop.passes >= 1 and self.clock.sleepers > 0, what=f"{loop.name} started")

    async def loop(
        self, cls: type[L], *, before_commit: Callable[[], Awaitable[None]] | None = None, **kwargs: Any
    ) -> L:
        """A loop with a writer fenced by a freshly acquired lease (long TTL: no renewer runs);
        ``before_commit`` runs once between its first decision and that decision's commit."""
        loop = cls(LoopDeps(self.conn, self.view, self.clock), live=self.live, **kwargs)
        leadership = await self.leadership(loop.name)
        if before_commit is None:
            loop.writer = loop.fenced_writer(leadership)
        else:
            loop.writer = InterleavingWriter(self.conn, self.view, lease=leadership.lease, before_commit=before_commit)
        loop.on_term_start()
        return loop

    async def leadership(self, name: str) -> Leadership:
        lease = Lease(self.conn, name, f"test-{name}", ttl=60.0)
        assert await lease.try_acquire()
        return Leadership(lease)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def live(conn: Connection, clock: FakeClock) -> AsyncIterator[LiveView]:
    lv = LiveView(conn, clock)
    await lv.start()
    try:
        yield lv
    finally:
        await lv.stop()


@pytest.fixture
def h(conn: Connection, view: StateView, writer: Writer, live: LiveView, clock: FakeClock) -> Harness:
    return Harness(conn, view, writer, live, clock)
