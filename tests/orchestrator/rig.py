"""Test rigs for the orchestrator: the reference's deploy rig and stateful rig on real NATS.

The orchestrator and the test share one view, so a step's writes are visible to the next assertion
(read-your-writes) and ``step`` is deterministic. Agent reports are written straight to the agent's
``observed.*`` keys. Time is a :class:`FakeClock`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers, copy_of
from shared import keys as K
from shared.clock import FakeClock, stamp
from shared.connection import Connection
from shared.decision import Decision
from shared.lease import Leadership, Lease
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.factories import node

RUN = pb.ASSIGNMENT_DESIRED_RUN
STOP = pb.ASSIGNMENT_DESIRED_STOP
PH = pb.DeploymentPhase


M = TypeVar("M", bound=Message)


def copied(msg: M | None) -> M:
    """A mutable copy of a message read from a view (which must exist)."""
    assert msg is not None
    return copy_of(msg)


def spec(min_replicas: int, *, max_replicas: int = 0, stateful: bool = False, volume: str = "") -> pb.ServiceSpec:
    s = pb.ServiceSpec(stateful=stateful)
    s.replicas.min = min_replicas
    s.replicas.max = max_replicas
    if volume:
        s.volumes.add(volume_name=volume, mount_path=f"/{volume}")
    return s


def release(release_id: str, env_id: str, image: str, service: pb.ServiceSpec, *, version: int = 1) -> pb.Release:
    r = pb.Release(environment_id=env_id, project_id="p1", app_id="a1", image_ref=image, version=version)
    r.meta.id = release_id
    r.service.CopyFrom(service)
    r.config_hash = f"hash-{release_id}"
    return r


def environment(env_id: str, service: pb.ServiceSpec, *, active: str = "") -> pb.Environment:
    e = pb.Environment(project_id="p1", app_id="a1", active_release_id=active, name=env_id)
    e.meta.id = env_id
    e.service.CopyFrom(service)
    return e


def replica(
    assignment_id: str, node_id: str, env_id: str, release_id: str, *, deployment_id: str = ""
) -> pb.Assignment:
    a = pb.Assignment(
        node_id=node_id,
        environment_id=env_id,
        release_id=release_id,
        project_id="p1",
        app_id="a1",
        desired=RUN,
        deployment_id=deployment_id,
    )
    a.meta.id = assignment_id
    return a


def deployment(
    deployment_id: str,
    env_id: str,
    release_id: str,
    *,
    previous: str = "",
    now: float | None = None,
    is_rollback: bool = False,
    build_id: str = "",
) -> pb.Deployment:
    d = pb.Deployment(
        environment_id=env_id,
        project_id="p1",
        app_id="a1",
        release_id=release_id,
        previous_release_id=previous,
        phase=pb.DEPLOYMENT_PHASE_PENDING,
        is_rollback=is_rollback,
        build_id=build_id,
    )
    d.meta.id = deployment_id
    if now is not None:
        stamp(d.meta.created_at, now)
        stamp(d.meta.updated_at, now)
    return d


@dataclass
class Rig:
    conn: Connection
    view: StateView
    writer: Writer
    clock: FakeClock
    orchestrator: Orchestrator
    env_id: str = "env-d"
    lease: Lease | None = field(default=None)

    async def put(self, *msgs: Message) -> None:
        txn = self.writer.txn("test")
        for msg in msgs:
            txn.put(msg)
        await self.writer.commit(txn)

    async def delete(self, *keys: str) -> None:
        txn = self.writer.txn("test")
        for key in keys:
            txn.delete(key)
        await self.writer.commit(txn)

    async def observe(self, assignments: list[pb.Assignment], state: int) -> None:
        """Write agent reports for these replicas (as their nodes' agents would)."""
        txn = self.writer.txn("agent")
        for a in assignments:
            observed = pb.AssignmentObserved(state=state, container_id=f"c-{a.meta.id}")  # type: ignore[arg-type]
            txn.put(observed, key=K.observed(a.node_id, a.meta.id))
        await self.writer.commit(txn)

    async def step(self, deployment_id: str = "dep1") -> Decision | None:
        return await self.orchestrator.reconcile(deployment_id)

    async def steps(self, n: int, deployment_id: str = "dep1") -> None:
        for _ in range(n):
            await self.step(deployment_id)

    def deployment(self, deployment_id: str = "dep1") -> pb.Deployment:
        d = self.view.deployment(deployment_id)
        assert d is not None
        return d

    def phase(self, deployment_id: str = "dep1") -> int:
        return self.deployment(deployment_id).phase

    def env(self) -> pb.Environment:
        e = self.view.env(self.env_id)
        assert e is not None
        return e

    def green(self, deployment_id: str = "dep1") -> list[pb.Assignment]:
        return [a for a in self.view.assignments(self.env_id) if a.deployment_id == deployment_id and a.desired == RUN]

    def run_of(self, release_id: str) -> list[pb.Assignment]:
        return [a for a in self.view.assignments(self.env_id) if a.release_id == release_id and a.desired == RUN]

    def blue(self) -> list[pb.Assignment]:
        return [a for a in self.view.assignments(self.env_id) if a.meta.id.startswith("blue-")]

    def running(self) -> list[pb.Assignment]:
        return [a for a in self.view.assignments(self.env_id) if a.desired == RUN]


@contextlib.asynccontextmanager
async def make_rig(conn: Connection, *, timers: Timers | None = None) -> AsyncIterator[Rig]:
    """An orchestrator holding the lease (fenced writes) over a fresh view, plus an unfenced test writer."""
    view = StateView(conn, name="rig")
    await view.start()
    clock = FakeClock()
    orchestrator = Orchestrator(LoopDeps(conn, view, clock), timers=timers or Timers())
    lease = Lease(conn, "orchestrator", "rig", ttl=60)
    assert await lease.try_acquire()
    orchestrator.writer = orchestrator.fenced_writer(Leadership(lease))
    try:
        yield Rig(conn, view, Writer(conn, view), clock, orchestrator, lease=lease)
    finally:
        await view.stop()


async def seed_deploy_rig(rig: Rig) -> None:
    """§9.1: n1, n2 (1000 m / 4096 MB); min 2; rel1 active with blue-0 on n1 and blue-1 on n2; dep1 rel1 -> rel2."""
    s = spec(2)
    await rig.put(
        node("n1", cpu=1000, mem=4096),
        node("n2", cpu=1000, mem=4096),
        release("rel1", rig.env_id, "app:v1", s, version=1),
        release("rel2", rig.env_id, "app:v2", s, version=2),
        environment(rig.env_id, s, active="rel1"),
        replica("blue-0", "n1", rig.env_id, "rel1"),
        replica("blue-1", "n2", rig.env_id, "rel1"),
        deployment("dep1", rig.env_id, "rel2", previous="rel1", now=rig.clock.now()),
    )


async def seed_stateful_rig(rig: Rig) -> None:
    """§9.2: min = max = 1, stateful, volume "data" on n1 (ACTIVE); blue-0 on n1 observed HEALTHY."""
    s = spec(1, max_replicas=1, stateful=True, volume="data")
    volume = pb.Volume(project_id="p1", environment_id=rig.env_id, name="data", node_id="n1")
    volume.status = pb.VOLUME_STATUS_ACTIVE
    volume.meta.id = "vol-data"
    blue0 = replica("blue-0", "n1", rig.env_id, "rel1")
    await rig.put(
        node("n1", cpu=1000, mem=4096),
        node("n2", cpu=1000, mem=4096),
        release("rel1", rig.env_id, "db:v1", s, version=1),
        release("rel2", rig.env_id, "db:v2", s, version=2),
        environment(rig.env_id, s, active="rel1"),
        volume,
        blue0,
        deployment("dep1", rig.env_id, "rel2", previous="rel1", now=rig.clock.now()),
    )
    await rig.observe([blue0], pb.INSTANCE_STATE_HEALTHY)


async def settle() -> None:
    """Let already-scheduled callbacks run (no timer semantics depend on this)."""
    for _ in range(3):
        await asyncio.sleep(0)
