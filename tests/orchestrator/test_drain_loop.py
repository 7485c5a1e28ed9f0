"""The orchestrator loop ends a drain when the proxies report nothing in flight to the old release (issue
42): real NATS, the proxies' heartbeats in ``zattera-live`` as a proxy publishes them, a fake clock, an
hour-long tick (what happens is woken by a heartbeat, never by a tick)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers
from shared import keys as K
from shared.clock import FakeClock, to_timestamp
from shared.connection import Connection
from shared.deploy import Deployer
from shared.lease import run_while_leading
from shared.live import LiveView, publish_proxy_heartbeat
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent_sim import AgentSim
from tests.factories import node
from tests.orchestrator.rig import environment, release, replica, spec
from tests.waiting import eventually

PH = pb.DeploymentPhase
ENV = "env-dl"
TIMERS = Timers(drain_window=600, drain_quiet=4)
HOUR = 3600.0


@dataclass
class Draining:
    conn: Connection
    view: StateView
    live: LiveView
    clock: FakeClock
    deployer: Deployer

    def phase(self, deployment_id: str) -> int:
        d = self.view.deployment(deployment_id)
        return d.phase if d is not None else -1

    async def heartbeat(self, proxy_id: str, old_inflight: int) -> None:
        """A proxy's heartbeat sampled now, routing by the env as it is now; waits until the orchestrator's
        live view holds it."""
        hb = cpb.ProxyHeartbeat(proxy_id=proxy_id, time=to_timestamp(self.clock.now()), drain_counts=True)
        hb.routes_version = self.view.rev(K.env(ENV))
        if old_inflight:
            hb.old_inflight[ENV] = old_inflight
        await publish_proxy_heartbeat(self.conn, hb)
        await eventually(
            lambda: any(p == hb for p in self.live.fresh_proxy_heartbeats()), 10, f"{proxy_id}'s heartbeat seen"
        )


@pytest.fixture
async def draining(conn: Connection) -> AsyncIterator[Draining]:
    view = StateView(conn, name="test")
    await view.start()
    writer = Writer(conn, view)
    s = spec(2)
    await writer.commit(
        writer.txn()
        .put(node("n1"))
        .put(node("n2"))
        .put(release("rel1", ENV, "app:v1", s))
        .put(environment(ENV, s, active="rel1"))
        .put(replica("blue-0", "n1", ENV, "rel1"))
        .put(replica("blue-1", "n2", ENV, "rel1"))
    )
    clock = FakeClock()
    live = LiveView(conn, clock)
    await live.start()
    orch_view = StateView(conn, name="orchestrator")
    await orch_view.start()
    orchestrator = Orchestrator(LoopDeps(conn, orch_view, clock), timers=TIMERS, tick=HOUR, live=live)
    leader = asyncio.create_task(
        run_while_leading(conn, "orchestrator", orchestrator.run, holder="test-orchestrator", ttl=5, renew_interval=1)
    )
    agent = await AgentSim(conn).start()
    try:
        yield Draining(conn, view, live, clock, Deployer(writer, clock=clock))
    finally:
        leader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader
        await agent.stop()
        await orch_view.stop()
        await live.stop()
        await view.stop()


async def test_the_old_release_stops_once_every_proxy_reports_nothing_in_flight_to_it(draining: Draining) -> None:
    created = await draining.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await eventually(lambda: draining.phase(dep) == PH.DEPLOYMENT_PHASE_DRAINING_OLD, 10, "promoted")
    # Inside the quiet period, and then a long request still in flight at p2: the old release stays.
    await draining.heartbeat("p1", 0)
    await draining.heartbeat("p2", 0)
    await draining.clock.advance(TIMERS.drain_quiet + 1)
    await draining.heartbeat("p2", 1)
    await draining.heartbeat("p1", 0)
    assert draining.phase(dep) == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    # The request ended: every live proxy reports zero, long before the drain window's end.
    await draining.clock.advance(2)
    await draining.heartbeat("p2", 0)
    await eventually(lambda: draining.phase(dep) == PH.DEPLOYMENT_PHASE_SUCCEEDED, 10, "drained early")
    stopped = {a.meta.id for a in draining.view.assignments(ENV) if a.desired == pb.ASSIGNMENT_DESIRED_STOP}
    assert stopped == {"blue-0", "blue-1"}
    d = draining.view.deployment(dep)
    assert d is not None and d.meta.updated_at.ToSeconds() < d.drain_deadline.ToSeconds()
