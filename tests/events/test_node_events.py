"""Node events on real NATS with a fake clock: liveness (DOWN and back, by the liveness loop), a drain
(DRAINING by the operator, DRAINED by the scheduler once empty), each with who decided and from → to;
and the events of one publish call stored in their order."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.scheduler.liveness import Liveness
from services.scheduler.loop import Scheduler
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection
from shared.events import EventPublisher, make_event
from shared.live import LiveView, publish_node_heartbeat
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.eventlog import stored_events
from tests.factories import node
from tests.waiting import eventually


def summary(events: list[pb.Event]) -> list[tuple[str, str, str, str, str]]:
    return [(e.kind, e.node_id, e.fields["actor"], e.fields["from"], e.fields["to"]) for e in events]


async def test_a_silent_node_goes_down_and_comes_back(conn: Connection, view: StateView, writer: Writer) -> None:
    clock = FakeClock()
    live = LiveView(conn, clock)
    await live.start()
    await writer.commit(writer.txn().create(node("n1")))
    loop = Liveness(LoopDeps(conn, view, clock), live=live, grace=0, deadline=30)
    loop.writer = writer
    loop.on_term_start()
    down_revision = view.rev(K.node("n1"))
    await clock.advance(31)
    await loop.pass_once()
    beat = cpb.Heartbeat(node_id="n1")
    beat.time.FromNanoseconds(int(clock.now() * 1e9))
    await publish_node_heartbeat(conn, beat)
    await eventually(lambda: live.node_seen_at("n1") == clock.now(), what="heartbeat seen")
    await loop.pass_once()
    events = await stored_events(conn)
    assert summary(events) == [
        ("node.down", "n1", "system:liveness", "ALIVE", "DOWN"),
        ("node.up", "n1", "system:liveness", "DOWN", "ALIVE"),
    ]
    assert events[0].transition == f"node.n1@{down_revision}:node.down"
    await live.stop()


async def test_a_drained_node_is_announced_by_the_scheduler(conn: Connection, view: StateView, writer: Writer) -> None:
    await writer.commit(writer.txn().create(node("n1", status=pb.NODE_STATUS_DRAINING, schedulable=False)))
    scheduler = Scheduler(LoopDeps(conn, view, FakeClock()))
    scheduler.writer = writer
    await scheduler.pass_once()
    drained = view.node("n1")
    assert drained is not None and drained.status == pb.NODE_STATUS_DRAINED
    assert summary(await stored_events(conn)) == [("node.drained", "n1", "system:drain", "DRAINING", "DRAINED")]


async def test_events_of_one_call_are_stored_in_order(conn: Connection) -> None:
    batch = [make_event(f"test.e{i}", str(i), transition=f"t@{i}:e") for i in range(50)]
    await EventPublisher(conn).publish(*batch)
    assert [e.message for e in await stored_events(conn)] == [str(i) for i in range(50)]
