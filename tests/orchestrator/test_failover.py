"""Leader failover mid-deployment (the reference's chaos C1–C6 and its stateful counterpart, adapted to
SIGKILLed orchestrator processes on real NATS): the deployment still ends SUCCEEDED and the invariants
I1–I7 hold at every observed state. Two representative kills run by default; the full matrix is
``-m chaos``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from shared.connection import connect
from shared.deploy import Deployer
from shared.provisioning import provision
from shared.txn import Writer
from tests.agent_sim import AgentSim
from tests.factories import node
from tests.orchestrator.failover import InvariantView, Orchestrators, invariant_violations, is_done
from tests.orchestrator.rig import copied, environment, release, replica, spec
from tests.waiting import eventually

PH = pb.DeploymentPhase
RUN = pb.ASSIGNMENT_DESIRED_RUN
RUNNING = pb.INSTANCE_STATE_RUNNING
HEALTHY = pb.INSTANCE_STATE_HEALTHY
WORKERS = ("w1", "w2", "w3")

RED_GREEN_ORDER: list[int] = [
    PH.DEPLOYMENT_PHASE_PENDING,
    PH.DEPLOYMENT_PHASE_PLACING,
    PH.DEPLOYMENT_PHASE_STARTING,
    PH.DEPLOYMENT_PHASE_HEALTHCHECKING,
    PH.DEPLOYMENT_PHASE_PROMOTING,
    PH.DEPLOYMENT_PHASE_DRAINING_OLD,
    PH.DEPLOYMENT_PHASE_SUCCEEDED,
]
STATEFUL_ORDER: list[int] = [
    PH.DEPLOYMENT_PHASE_PENDING,
    PH.DEPLOYMENT_PHASE_STOPPING_OLD,
    PH.DEPLOYMENT_PHASE_STARTING,
    PH.DEPLOYMENT_PHASE_HEALTHCHECKING,
    PH.DEPLOYMENT_PHASE_PROMOTING,
    PH.DEPLOYMENT_PHASE_SUCCEEDED,
]


@dataclass
class Cluster:
    view: InvariantView
    writer: Writer
    agent: AgentSim
    orchestrators: Orchestrators
    deployer: Deployer

    async def reach_at_least(self, deployment_id: str, phase: int, order: list[int], timeout: float = 20.0) -> None:
        def reached() -> bool:
            d = self.view.deployment(deployment_id)
            if d is None:
                return False
            assert d.phase in order, f"deployment ended {PH.Name(d.phase)}: {d.error}"
            return order.index(d.phase) >= order.index(phase)

        await eventually(reached, timeout, f"phase >= {PH.Name(phase)}")  # type: ignore[arg-type]

    async def set_schedulable(self, schedulable: bool) -> None:
        txn = self.writer.txn()
        for w in WORKERS:
            n = copied(self.view.node(w))
            assert n is not None
            n.schedulable = schedulable
            txn.put(n)
        await self.writer.commit(txn)


@pytest.fixture
async def cluster(nats_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    conn = await connect(nats_url, name="failover-test")
    await provision(conn.js)
    view = InvariantView(conn)
    await view.start()
    writer = Writer(conn, view)
    agent = await AgentSim(conn).start()
    orchestrators = Orchestrators(nats_url, tmp_path)
    orchestrators.start()
    orchestrators.start()
    try:
        await orchestrators.wait_running()
        yield Cluster(view, writer, agent, orchestrators, Deployer(writer))
    finally:
        orchestrators.stop_all()
        # Bounded: a teardown step stuck on a connection must not hang the suite.
        for step in (agent.stop(), view.stop(), conn.close()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(step, 10)


async def seed_red_green(c: Cluster) -> None:
    s = spec(2)
    txn = c.writer.txn()
    for w in WORKERS:
        txn.put(node(w, cpu=8000, mem=16384))
    txn.put(release("crel-blue", "cenv", "app:v1", s)).put(environment("cenv", s, active="crel-blue"))
    txn.put(replica("blue-1", "w1", "cenv", "crel-blue")).put(replica("blue-2", "w2", "cenv", "crel-blue"))
    await c.writer.commit(txn)


async def seed_stateful(c: Cluster) -> None:
    s = spec(1, max_replicas=1, stateful=True, volume="data")
    volume = pb.Volume(project_id="p1", environment_id="senv", name="data", node_id="w1")
    volume.status = pb.VOLUME_STATUS_ACTIVE
    volume.meta.id = "vol-data"
    txn = c.writer.txn()
    for w in WORKERS:
        txn.put(node(w, cpu=8000, mem=16384))
    txn.put(release("srel-1", "senv", "db:v1", s)).put(environment("senv", s, active="srel-1")).put(volume)
    txn.put(replica("old-0", "w1", "senv", "srel-1"))
    await c.writer.commit(txn)


TRANSIENT_PHASES = {PH.DEPLOYMENT_PHASE_PROMOTING}
"""Phases no gate can hold (one write leads out of them): the kill lands in them or just after."""


async def kill_leader_at(c: Cluster, env_id: str, phase: int, order: list[int]) -> str:
    """Create a deployment, SIGKILL the leading orchestrator once it is at ``phase``, return the deployment id.
    Asserts the deployment was in ``phase`` when the leader died (or, for a transient phase, at most one
    step past it), so a kill that missed its phase cannot pass silently."""
    leader = await c.orchestrators.wait_leader(c.view)
    if phase == PH.DEPLOYMENT_PHASE_PENDING:
        c.orchestrators.freeze(leader)  # a frozen leader cannot act: the deployment is PENDING when it dies
        created = await c.deployer.deploy_image(env_id, "app:v2")
    elif phase == PH.DEPLOYMENT_PHASE_PLACING:
        await c.set_schedulable(False)  # nowhere to place yet: the deployment waits in PLACING
        created = await c.deployer.deploy_image(env_id, "app:v2")
        await c.reach_at_least(created.deployment.meta.id, phase, order)
    else:
        created = await c.deployer.deploy_image(env_id, "app:v2")
        await c.reach_at_least(created.deployment.meta.id, phase, order)
    at_kill = c.view.deployment(created.deployment.meta.id)
    c.orchestrators.kill(leader)
    assert at_kill is not None
    allowed = {phase, order[order.index(phase) + 1]} if phase in TRANSIENT_PHASES else {phase}
    assert at_kill.phase in allowed, f"killed in {PH.Name(at_kill.phase)}, not {PH.Name(phase)}"
    await c.orchestrators.wait_leader(c.view, other_than=leader)
    if phase == PH.DEPLOYMENT_PHASE_PLACING:
        await c.set_schedulable(True)
    return created.deployment.meta.id


def gates_for(c: Cluster, phase: int) -> None:
    """Pause the deployment at the phase to kill in (the reference's gates: none, running, healthy)."""
    pausing: dict[int, int | None] = {
        PH.DEPLOYMENT_PHASE_STARTING: None,
        PH.DEPLOYMENT_PHASE_HEALTHCHECKING: RUNNING,
    }
    c.agent.green_state = pausing.get(phase, HEALTHY)
    c.agent.report_stopped = phase != PH.DEPLOYMENT_PHASE_STOPPING_OLD


async def finish_and_check(c: Cluster, deployment_id: str) -> pb.Deployment:
    c.agent.green_state = HEALTHY
    c.agent.report_stopped = True
    c.agent.poke()
    await eventually(lambda: is_done(c.view, deployment_id), 30, "the deployment finishes")
    d = c.view.deployment(deployment_id)
    assert d is not None
    assert d.phase == PH.DEPLOYMENT_PHASE_SUCCEEDED, f"{PH.Name(d.phase)}: {d.error}\n{c.orchestrators.logs()}"
    assert c.view.checks > 0
    assert c.view.violations == [], c.view.violations
    assert invariant_violations(c.view) == []
    return d


def chaos_unless(default: bool, value: int) -> object:
    return pytest.param(value, id=PH.Name(value), marks=() if default else pytest.mark.chaos)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "phase",
    [chaos_unless(p == PH.DEPLOYMENT_PHASE_HEALTHCHECKING, p) for p in RED_GREEN_ORDER[:-1]],
)
async def test_red_green_deploy_survives_a_leader_kill(cluster: Cluster, phase: int) -> None:
    await seed_red_green(cluster)
    gates_for(cluster, phase)
    dep = await kill_leader_at(cluster, "cenv", phase, RED_GREEN_ORDER)
    d = await finish_and_check(cluster, dep)
    env = cluster.view.env("cenv")
    assert env is not None and env.active_release_id == d.release_id
    run = [a for a in cluster.view.assignments("cenv") if a.desired == RUN]
    assert sorted(a.release_id for a in run) == [d.release_id, d.release_id]
    assert all(a.deployment_id == dep for a in run)


@pytest.mark.parametrize(
    "phase",
    [chaos_unless(p == PH.DEPLOYMENT_PHASE_STOPPING_OLD, p) for p in STATEFUL_ORDER[:-1]],
)
async def test_stateful_deploy_survives_a_leader_kill(cluster: Cluster, phase: int) -> None:
    await seed_stateful(cluster)
    gates_for(cluster, phase)
    dep = await kill_leader_at(cluster, "senv", phase, STATEFUL_ORDER)
    d = await finish_and_check(cluster, dep)
    run = [a for a in cluster.view.assignments("senv") if a.desired == RUN]
    assert [(a.release_id, a.node_id) for a in run] == [(d.release_id, "w1")]
    assert [v.node_id for v in cluster.view.volumes("senv")] == ["w1"]


async def test_an_isolated_leader_is_replaced_during_placing_and_its_late_writes_are_refused(cluster: Cluster) -> None:
    """C7 adapted: the leader freezes (cut off: no writes, no renewals) while PLACING; a standby takes over
    and finishes; the old leader then wakes with a stale view and a lapsed lease — and writes nothing."""
    await seed_red_green(cluster)
    gates_for(cluster, PH.DEPLOYMENT_PHASE_PLACING)
    old = await cluster.orchestrators.wait_leader(cluster.view)
    await cluster.set_schedulable(False)
    created = await cluster.deployer.deploy_image("cenv", "app:v2")
    dep = created.deployment.meta.id
    await cluster.reach_at_least(dep, PH.DEPLOYMENT_PHASE_PLACING, RED_GREEN_ORDER)
    cluster.orchestrators.freeze(old)
    await cluster.orchestrators.wait_leader(cluster.view, other_than=old)
    await cluster.set_schedulable(True)
    await finish_and_check(cluster, dep)
    cluster.orchestrators.thaw(old)
    await eventually(
        lambda: "lease orchestrator lost" in cluster.orchestrators.log(old), 10, "the old leader steps down"
    )
    await finish_and_check(cluster, dep)
    assert len([a for a in cluster.view.assignments("cenv") if a.desired == RUN]) == 2


async def test_losing_a_worker_mid_deploy_leaves_no_run_replica_on_it(cluster: Cluster) -> None:
    """C8: a node holding green (and blue) goes DOWN while HEALTHCHECKING; its green is re-placed before
    promotion, its blue is stopped by the drain, so nothing desired-RUN is left on it."""
    await seed_red_green(cluster)
    gates_for(cluster, PH.DEPLOYMENT_PHASE_HEALTHCHECKING)
    created = await cluster.deployer.deploy_image("cenv", "app:v2")
    dep = created.deployment.meta.id
    await cluster.reach_at_least(dep, PH.DEPLOYMENT_PHASE_HEALTHCHECKING, RED_GREEN_ORDER)
    victim = "w1"
    assert victim in {a.node_id for a in cluster.view.assignments("cenv") if a.deployment_id == dep}
    cluster.agent.dead_nodes.add(victim)
    down = copied(cluster.view.node(victim))
    assert down is not None
    down.status = pb.NODE_STATUS_DOWN
    await cluster.writer.commit(cluster.writer.txn().put(down))
    await finish_and_check(cluster, dep)
    assert [a.meta.id for a in cluster.view.assignments_by_node(victim) if a.desired == RUN] == []


@pytest.mark.chaos
async def test_an_env_write_during_a_leader_kill_survives_the_promotion(cluster: Cluster) -> None:
    """C12 adapted: an operator changes the env while the leader dies mid-deploy; the promotion (a fenced
    whole-env write) must not clobber it."""
    await seed_red_green(cluster)
    gates_for(cluster, PH.DEPLOYMENT_PHASE_STARTING)
    dep = await kill_leader_at(cluster, "cenv", PH.DEPLOYMENT_PHASE_STARTING, RED_GREEN_ORDER)
    env = copied(cluster.view.env("cenv"))
    assert env is not None
    env.service.replicas.max = 7
    await cluster.writer.commit(cluster.writer.txn().put(env))
    d = await finish_and_check(cluster, dep)
    final = cluster.view.env("cenv")
    assert final is not None and final.service.replicas.max == 7 and final.active_release_id == d.release_id
