"""The orchestrator loop running under its lease on real NATS, with the agent simulator and a fake clock.

The tick is an hour: everything here must happen because of a change or a deadline, never a tick.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from zattera.v1 import types_pb2 as pb

from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers
from shared.clock import FakeClock
from shared.connection import Connection
from shared.deploy import Deployer
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent_sim import AgentSim
from tests.factories import node
from tests.orchestrator.rig import copied, environment, release, replica, spec
from tests.waiting import eventually

PH = pb.DeploymentPhase
RUN = pb.ASSIGNMENT_DESIRED_RUN
ENV = "env-l"
TIMERS = Timers(drain_window=60)
HOUR = 3600.0


@dataclass
class Running:
    view: StateView
    writer: Writer
    clock: FakeClock
    agent: AgentSim
    deployer: Deployer
    orchestrator: Orchestrator

    def phase(self, deployment_id: str) -> int:
        d = self.view.deployment(deployment_id)
        return d.phase if d is not None else -1

    async def reaches(self, deployment_id: str, phase: int, timeout: float = 10.0) -> None:
        await eventually(lambda: self.phase(deployment_id) == phase, timeout, f"{PH.Name(phase)}")  # type: ignore[arg-type]

    def green(self, deployment_id: str) -> list[pb.Assignment]:
        return [a for a in self.view.assignments(ENV) if a.deployment_id == deployment_id and a.desired == RUN]


@pytest.fixture
async def running(conn: Connection) -> AsyncIterator[Running]:
    view = StateView(conn, name="test")
    await view.start()
    writer = Writer(conn, view)
    s = spec(2)
    await writer.commit(
        writer.txn()
        .put(node("n1"))
        .put(node("n2"))
        .put(node("n3"))
        .put(release("rel1", ENV, "app:v1", s))
        .put(environment(ENV, s, active="rel1"))
        .put(replica("blue-0", "n1", ENV, "rel1"))
        .put(replica("blue-1", "n2", ENV, "rel1"))
    )
    clock = FakeClock()
    orch_view = StateView(conn, name="orchestrator")
    await orch_view.start()
    orchestrator = Orchestrator(LoopDeps(conn, orch_view, clock), timers=TIMERS, tick=HOUR)
    leader = asyncio.create_task(
        run_while_leading(conn, "orchestrator", orchestrator.run, holder="test-orchestrator", ttl=5, renew_interval=1)
    )
    agent = await AgentSim(conn).start()
    try:
        yield Running(view, writer, clock, agent, Deployer(writer, clock=clock), orchestrator)
    finally:
        leader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader
        await agent.stop()
        await orch_view.stop()
        await view.stop()


async def test_a_deploy_runs_to_draining_on_changes_alone_and_succeeds_at_the_drain_deadline(
    running: Running,
) -> None:
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    env = running.view.env(ENV)
    assert env is not None and env.active_release_id == created.release.meta.id
    await running.clock.advance(TIMERS.drain_window)
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_SUCCEEDED)
    stopped = {a.meta.id for a in running.view.assignments(ENV) if a.desired == pb.ASSIGNMENT_DESIRED_STOP}
    assert stopped == {"blue-0", "blue-1"}


async def test_a_finished_build_wakes_the_loop_without_waiting_for_a_tick(running: Running) -> None:
    created = await running.deployer.deploy_source(ENV, tarball_digest="sha256:" + "0" * 64)
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_BUILDING)
    assert created.build is not None
    build = copied(created.build)
    build.status = pb.BUILD_STATUS_SUCCEEDED
    build.image_ref = "reg/app@sha256:1"
    await running.writer.commit(running.writer.txn().put(build))
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    rel = running.view.release(created.release.meta.id)
    assert rel is not None and rel.image_ref == "reg/app@sha256:1"


async def test_the_health_deadline_fires_from_the_clock(running: Running) -> None:
    running.agent.green_state = pb.INSTANCE_STATE_RUNNING
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_HEALTHCHECKING)
    await running.clock.advance(180.01)
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_FAILED)
    d = running.view.deployment(dep)
    assert d is not None and d.error == "green instances did not become healthy in time"
    await eventually(lambda: running.green(dep) == [])


async def test_a_placing_timeout_fails_the_deploy_naming_the_placement_error(running: Running) -> None:
    txn = running.writer.txn()
    for n in ("n1", "n2", "n3"):
        txn.put(node(n, cpu=100, mem=256))  # full: each holds one replica or nothing fits beside blue
    await running.writer.commit(txn)
    big = copied(running.view.env(ENV))
    assert big is not None
    big.service.resources.memory_mb = 512
    await running.writer.commit(running.writer.txn().put(big))
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_PLACING)
    await running.clock.advance(TIMERS.placing_timeout + 1)
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_FAILED)
    d = running.view.deployment(dep)
    assert d is not None
    assert d.error.startswith("PLACING timed out after 10m: placed 0 of 2 green replicas: placement: ")


async def test_a_node_going_down_mid_deploy_gets_its_green_replaced(running: Running) -> None:
    running.agent.green_state = pb.INSTANCE_STATE_RUNNING
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_HEALTHCHECKING)
    victim = running.green(dep)[0].node_id
    running.agent.dead_nodes.add(victim)
    await running.writer.commit(running.writer.txn().put(node(victim, status=pb.NODE_STATUS_DOWN)))
    await eventually(lambda: len(running.green(dep)) == 2 and victim not in {a.node_id for a in running.green(dep)})
    running.agent.green_state = pb.INSTANCE_STATE_HEALTHY
    running.agent.poke()
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    assert victim not in {a.node_id for a in running.green(dep)}


async def test_an_operator_cancel_is_acted_on_at_once(running: Running) -> None:
    running.agent.green_state = None
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_STARTING)
    await running.deployer.cancel(dep)
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_FAILED)
    assert [a for a in running.view.assignments(ENV) if a.deployment_id == dep] == []
    env = running.view.env(ENV)
    assert env is not None and env.active_release_id == "rel1"


async def test_a_warm_rollback_during_the_drain_promotes_without_new_replicas(running: Running) -> None:
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    before = {a.meta.id for a in running.view.assignments(ENV)}
    rollback = await running.deployer.rollback(ENV)
    await running.reaches(rollback.meta.id, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    assert running.phase(dep) == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert {a.meta.id for a in running.view.assignments(ENV)} == before
    env = running.view.env(ENV)
    assert env is not None and env.active_release_id == "rel1"
    await running.clock.advance(TIMERS.drain_window)
    await running.reaches(rollback.meta.id, PH.DEPLOYMENT_PHASE_SUCCEEDED)
    assert {a.meta.id for a in running.view.assignments(ENV) if a.desired == RUN} == {"blue-0", "blue-1"}
