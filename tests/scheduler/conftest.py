"""The scheduler test rig: a real NATS server, the state view, an unfenced writer, a fake clock and a
Scheduler whose passes the test drives one at a time (the reference tests' ``evaluate`` calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.scheduler.loop import Scheduler
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests.waiting import eventually

MARKER = "test.marker"


@dataclass
class Rig:
    conn: Connection
    view: StateView
    writer: Writer
    clock: FakeClock
    scheduler: Scheduler
    events: list[pb.Event] = field(default_factory=list)

    async def put(self, *msgs: Message) -> None:
        txn = self.writer.txn()
        for msg in msgs:
            txn.put(msg)
        await self.writer.commit(txn)

    async def delete(self, *keys: str) -> None:
        txn = self.writer.txn()
        for key in keys:
            txn.delete(key)
        await self.writer.commit(txn)

    async def observe(self, assignment_id: str, state: int, message: str = "") -> None:
        """What the agent of the assignment's node reports."""
        a = self.view.assignment(assignment_id)
        assert a is not None, assignment_id
        observed = pb.AssignmentObserved(state=state, message=message)  # type: ignore[arg-type]
        await self.writer.commit(self.writer.txn().put(observed, key=K.observed(a.node_id, assignment_id)))

    async def set_node(self, node_id: str, status: int, schedulable: bool | None = None) -> None:
        current = self.view.node(node_id)
        assert current is not None
        node = pb.Node()
        node.CopyFrom(current)
        node.status = status  # type: ignore[assignment]
        if schedulable is not None:
            node.schedulable = schedulable
        await self.put(node)

    async def pass_(self) -> None:
        await self.scheduler.pass_once()

    def assignments(self, env_id: str, desired: int | None = None) -> list[pb.Assignment]:
        return [a for a in self.view.assignments(env_id) if desired is None or a.desired == desired]

    def run(self, env_id: str) -> list[pb.Assignment]:
        return self.assignments(env_id, pb.ASSIGNMENT_DESIRED_RUN)

    def stop(self, env_id: str) -> list[pb.Assignment]:
        return self.assignments(env_id, pb.ASSIGNMENT_DESIRED_STOP)

    def run_nodes(self, env_id: str) -> list[str]:
        return sorted(a.node_id for a in self.run(env_id))

    async def settle_events(self) -> None:
        """Wait until every event published so far has been received (a marker sent after them arrives)."""
        marker = pb.Event(kind=MARKER)
        await self.conn.nc.publish(EVENTS_SUBJECT_PREFIX + MARKER, marker.SerializeToString())
        await eventually(lambda: any(e.kind == MARKER for e in self.events), what="events settled")
        self.events[:] = [e for e in self.events if e.kind != MARKER]

    async def kinds(self) -> list[str]:
        await self.settle_events()
        return [e.kind for e in self.events]


@pytest.fixture
async def rig(conn: Connection, view: StateView, writer: Writer) -> AsyncIterator[Rig]:
    clock = FakeClock()
    scheduler = Scheduler(LoopDeps(conn, view, clock))
    scheduler.writer = writer
    r = Rig(conn, view, writer, clock, scheduler)

    async def on_event(msg: object) -> None:
        r.events.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    sub = await conn.nc.subscribe(f"{EVENTS_SUBJECT_PREFIX}>", cb=on_event)
    await conn.nc.flush()
    yield r
    await sub.unsubscribe()
