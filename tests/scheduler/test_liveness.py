"""Node liveness: ALIVE ⇄ DOWN from heartbeats (pure table, then the loop on real NATS with a fake clock)."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.scheduler.liveness import Liveness, evaluate_liveness
from shared.clock import FakeClock
from shared.connection import Connection
from shared.live import LiveView, publish_node_heartbeat
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.factories import node
from tests.memory_state import MemoryState
from tests.waiting import eventually

ALIVE, DOWN = pb.NODE_STATUS_ALIVE, pb.NODE_STATUS_DOWN
DRAINING, DRAINED = pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED
NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("status", "heard_ago", "term_age", "expected"),
    [
        (ALIVE, 31, 50, DOWN),
        (ALIVE, 30, 50, None),
        (ALIVE, 31, 44, None),
        (ALIVE, None, 46, DOWN),
        (ALIVE, None, 30, None),
        (DOWN, 5, 50, ALIVE),
        (DOWN, 31, 50, None),
        (DOWN, None, 50, None),
        (DRAINING, 300, 500, None),
        (DRAINED, 300, 500, None),
        (DRAINED, 1, 500, None),
    ],
    ids=[
        "stale-alive-goes-down",
        "30s-is-still-fresh",
        "within-leader-grace",
        "never-heard-counts-from-term-start",
        "never-heard-within-deadline",
        "down-heartbeating-again-comes-up",
        "down-and-stale-stays-down",
        "down-never-heard-stays-down",
        "draining-is-never-touched",
        "drained-is-never-touched",
        "drained-heartbeating-stays-drained",
    ],
)
def test_liveness_decides_from_heartbeat_age(status, heard_ago, term_age, expected):
    state = MemoryState(node("n1", status=status))
    heard = {} if heard_ago is None else {"n1": NOW - heard_ago}
    writes = evaluate_liveness(state.store, heard.get, NOW, NOW - term_age)
    got = [w.puts[0].status for w in writes]  # type: ignore[attr-defined]
    assert got == ([] if expected is None else [expected])


def test_liveness_windows_are_settable():
    """Short windows (ZATTERA_NODE_HEARTBEAT_DEADLINE / ZATTERA_LIVENESS_GRACE) for tests and demos."""
    state = MemoryState(node("n1", status=ALIVE))
    heard = {"n1": NOW - 4}
    assert evaluate_liveness(state.store, heard.get, NOW, NOW - 10) == []
    writes = evaluate_liveness(state.store, heard.get, NOW, NOW - 10, deadline=3, grace=2)
    assert [w.puts[0].status for w in writes] == [DOWN]  # type: ignore[attr-defined]
    assert evaluate_liveness(state.store, heard.get, NOW, NOW - 1, deadline=3, grace=2) == []


async def heartbeat(conn: Connection, live: LiveView, node_id: str, at: float) -> None:
    hb = cpb.Heartbeat(node_id=node_id)
    hb.time.FromNanoseconds(int(at * 1e9))
    await publish_node_heartbeat(conn, hb)
    await eventually(lambda: live.node_seen_at(node_id) == at, what="heartbeat seen")


async def test_silent_node_goes_down_and_comes_back_with_events(conn: Connection, view: StateView, writer: Writer):
    clock = FakeClock()
    live = LiveView(conn, clock)
    await live.start()
    await writer.commit(writer.txn().create(node("n1")).create(node("n2", status=DRAINING)))
    loop = Liveness(LoopDeps(conn, view, clock), live=live)
    loop.writer = writer
    loop.on_term_start()
    events: list[pb.Event] = []

    async def on_event(msg: object) -> None:
        events.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe("zattera.events.node.>", cb=on_event)
    await heartbeat(conn, live, "n1", clock.now())
    await clock.advance(40)
    await loop.pass_once()
    assert view.node("n1").status == ALIVE  # stale, but the leader grace is not over
    await clock.advance(6)
    await loop.pass_once()
    assert view.node("n1").status == DOWN and view.node("n2").status == DRAINING
    await heartbeat(conn, live, "n1", clock.now())
    await loop.pass_once()
    assert view.node("n1").status == ALIVE
    await eventually(lambda: [e.kind for e in events] == ["node.down", "node.up"], what="events")
    assert events[0].node_id == "n1" and events[0].severity == "warning"
    assert events[0].message == "node n1 missed heartbeats for 46s; marked DOWN"
    assert events[1].message == "node n1 is heartbeating again; marked ALIVE"
    await live.stop()


async def test_a_term_taken_again_by_a_process_that_kept_hearing_marks_a_silent_node_down_without_a_new_grace(
    conn: Connection, view: StateView, writer: Writer
):
    """The leader's lease lost and taken again (the state stream electing a leader after a machine loss): its
    live view heard the heartbeats all along, so the machine's node is DOWN 30 s after its last heartbeat,
    not 45 s after the new term."""
    clock = FakeClock()
    live = LiveView(conn, clock)
    await live.start()
    await writer.commit(writer.txn().create(node("n1")))
    loop = Liveness(LoopDeps(conn, view, clock), live=live)
    loop.writer = writer
    loop.on_term_start()
    await clock.advance(70)
    await heartbeat(conn, live, "n1", clock.now())  # its last heartbeat; then its machine is lost
    await clock.advance(30)
    loop.on_term_start()  # the same process leads again, in a new term
    await clock.advance(1)
    await loop.pass_once()
    assert view.node("n1").status == DOWN
    await live.stop()
