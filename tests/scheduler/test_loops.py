"""The loops as they run in the service: leader gating, event-driven passes, no hot loop,
and the service wiring."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from zattera.v1 import types_pb2 as pb

from services.scheduler.__main__ import build
from services.scheduler.loop import Scheduler
from services.scheduler.volumes import LEASE_TTL
from shared.clock import FakeClock, from_timestamp
from shared.connection import Connection
from shared.lease import Leadership, Lease, run_while_leading
from shared.loop import LoopDeps
from shared.service import ServiceContext
from shared.settings import Settings
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.txn import Writer
from tests.scheduler.builders import spec_env, spec_release, unlimited
from tests.waiting import eventually


class CountingScheduler(Scheduler):
    """Counts terms and whether a term is running."""

    terms = 0
    running = False

    async def run(self, leadership: Leadership) -> None:
        self.terms += 1
        self.running = True
        try:
            await super().run(leadership)
        finally:
            self.running = False


@contextlib.asynccontextmanager
async def leading(conn: Connection, loop: Scheduler, holder: str = "me") -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder=holder, ttl=3, renew_interval=0.1))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def take_lease_away(conn: Connection, rival: Lease) -> None:
    """Delete the lease key behind the holder's back (a partition would do the same), then let a rival take it."""
    await conn.js.publish(STATE_PREFIX + rival.key, b"", headers={"KV-Operation": "DEL"}, stream=STATE_STREAM)
    assert await rival.try_acquire()


# ---------------------------------------------------------------- §4.10 leaderrunner_test.go


async def test_loop_runs_only_while_leading(conn: Connection, view: StateView):
    loop = CountingScheduler(LoopDeps(conn, view, FakeClock()))
    rival = Lease(conn, "scheduler", "rival", ttl=3)
    assert await rival.try_acquire()
    async with leading(conn, loop) as task:
        await asyncio.sleep(0.1)  # a window in which it must not run
        assert loop.terms == 0
        await rival.release()
        await eventually(lambda: loop.running, timeout=2, what="elected")
        await take_lease_away(conn, rival)
        await eventually(lambda: not loop.running, timeout=2, what="demoted")
        await asyncio.sleep(0.15)
        assert loop.terms == 1
        await rival.release()
        await eventually(lambda: loop.running, timeout=2, what="re-elected")
        assert loop.terms == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)


async def test_cancel_while_never_leading_returns_promptly(conn: Connection, view: StateView):
    loop = CountingScheduler(LoopDeps(conn, view, FakeClock()))
    rival = Lease(conn, "scheduler", "rival", ttl=3)
    assert await rival.try_acquire()
    async with leading(conn, loop) as task:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
    assert loop.terms == 0


# ---------------------------------------------------------------- event-driven passes


async def test_new_env_is_placed_on_the_change_without_waiting_for_the_tick(conn: Connection, view: StateView):
    loop = Scheduler(LoopDeps(conn, view, FakeClock()))
    api = Writer(conn, StateView(None))  # another process's writes arrive through the watch
    rel = spec_release("rel1", "env1", min_replicas=2)
    await api.commit(api.txn().create(unlimited("n1")).create(unlimited("n2")).create(rel))
    async with leading(conn, loop):
        await eventually(lambda: loop.passes >= 1, what="first pass")
        await api.commit(api.txn().create(spec_env("env1", rel)))
        await eventually(lambda: view.env_run_count("env1") == 2, what="replicas placed")


async def test_lease_renewal_does_not_wake_the_loop_again_fix_hot_loop(conn: Connection, view: StateView):
    """Reference: every pass rewrote the lease, a watched Volume change, so the loop spun at apply speed."""
    clock = FakeClock()
    loop = Scheduler(LoopDeps(conn, view, clock))
    api = Writer(conn, StateView(None))
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data",))
    await api.commit(api.txn().create(unlimited("n1")).create(rel).create(spec_env("env1", rel, project_id="p1")))

    def lease_expiry() -> float:
        vols = view.volumes("env1")
        return from_timestamp(vols[0].lease.expires_at) if vols and vols[0].HasField("lease") else 0.0

    async with leading(conn, loop):
        await eventually(lambda: lease_expiry() > 0, what="lease acquired")
        await eventually(lambda: clock.sleepers > 0, what="loop idle")
        settled = loop.passes
        await asyncio.sleep(0.2)
        assert loop.passes == settled

        acquired = lease_expiry()
        await clock.advance(15)  # the tick: 45 s of lease left, nothing to renew
        await eventually(lambda: loop.passes == settled + 1 and clock.sleepers > 0, what="tick pass")
        assert lease_expiry() == acquired
        await clock.advance(15)  # 30 s left: renewed, and the renewal does not trigger another pass
        await eventually(lambda: lease_expiry() == clock.now() + LEASE_TTL, what="renewed")
        await asyncio.sleep(0.2)
        assert loop.passes == settled + 2


# ---------------------------------------------------------------- the service wiring


async def test_service_build_runs_placement_and_liveness_under_their_leases(conn: Connection, view: StateView):
    clock = FakeClock()
    ctx = ServiceContext("scheduler", Settings(lease_ttl=3, lease_renew=0.1), conn, view, clock, "svc")
    api = Writer(conn, StateView(None))
    rel = spec_release("rel1", "env1", min_replicas=1)
    await api.commit(api.txn().create(unlimited("n1")).create(rel).create(spec_env("env1", rel)))
    tasks = [asyncio.create_task(c) for c in await build(ctx)]
    try:
        await eventually(lambda: view.env_run_count("env1") == 1, what="placed by the service")
        await eventually(lambda: {view.lease("scheduler") is not None, view.lease("liveness") is not None} == {True})

        async def n1_down() -> bool:  # n1 never heartbeats: DOWN once the liveness grace is over
            await clock.advance(5)
            return view.node("n1").status == pb.NODE_STATUS_DOWN

        await eventually(n1_down, what="liveness ran")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
