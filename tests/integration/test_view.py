"""StateView on a real NATS server: decode, join, indexes, bad input, restarts."""

from __future__ import annotations

import os

import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import connect
from shared.embedded import EmbeddedNats
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX
from shared.txn import Writer
from tests.factories import assignment, env, node, release
from tests.waiting import eventually


@pytest.mark.parametrize("kind", sorted(K.ALL_KINDS))
async def test_garbage_under_any_key_kind_is_skipped_and_counted(conn, view: StateView, writer: Writer, kind: str):
    key = f"{kind}.n1.bad" if kind in K.PER_NODE_KINDS else f"{kind}.bad"
    await conn.js.publish(STATE_PREFIX + key, b"\xff\xfe\x00garbage" + os.urandom(8))
    await writer.commit(writer.txn().create(node("after")))
    await eventually(lambda: view.skipped == 1, what="garbage counted")
    assert view.node("after") is not None
    assert view.get(kind, "bad") is None
    assert view.rev(key) > 0  # a writer can still overwrite it with a fenced write


async def test_unknown_key_kind_is_skipped_and_counted(conn, view: StateView, writer: Writer):
    await conn.js.publish(STATE_PREFIX + "weird.thing", b"x")
    await writer.commit(writer.txn().create(node("n1")))
    await eventually(lambda: view.skipped == 1)
    assert view.node("n1") is not None


async def test_view_sees_other_writers_changes_in_order(conn, view: StateView):
    other_view = StateView(conn, name="writer")
    await other_view.start()
    other = Writer(conn, other_view)
    feed = view.subscribe({K.ENV})
    for i in range(30):
        e = env("e1", min_replicas=i)
        await other.commit(other.txn().put(e))
    await eventually(lambda: view.env("e1") is not None and view.env("e1").service.replicas.min == 29)
    assert feed.drain() == {(K.ENV, "e1")}
    await other_view.stop()


async def test_observed_running_does_not_downgrade_healthy_of_the_same_container(conn, view, writer):
    a = assignment("n1", "e1", "r1")
    await writer.commit(writer.txn().create(a))
    okey = K.observed("n1", a.meta.id)
    for state in (pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_RUNNING):
        await writer.commit(writer.txn().put(pb.AssignmentObserved(state=state, container_id="c1"), key=okey))
    assert view.assignment(a.meta.id).observed.state == pb.INSTANCE_STATE_HEALTHY
    # a new container is a new instance: its RUNNING is real
    await writer.commit(
        writer.txn().put(pb.AssignmentObserved(state=pb.INSTANCE_STATE_RUNNING, container_id="c2"), key=okey)
    )
    assert view.assignment(a.meta.id).observed.state == pb.INSTANCE_STATE_RUNNING


async def test_observed_for_another_node_is_not_joined(view, writer):
    a = assignment("n1", "e1", "r1")
    await writer.commit(writer.txn().create(a))
    await writer.commit(
        writer.txn().put(pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY), key=K.observed("n2", a.meta.id))
    )
    assert not view.assignment(a.meta.id).HasField("observed")


async def test_reservations_and_env_counts_are_incremental(view: StateView, writer: Writer):
    await writer.commit(writer.txn().create(release("r1", "e1", cpu=500, mem=1024)).create(release("r2", "e2")))
    a1 = assignment("n1", "e1", "r1")
    a2 = assignment("n1", "e2", "r2")
    a3 = assignment("n2", "e1", "r1")
    await writer.commit(writer.txn().create(a1).create(a2).create(a3))
    assert view.reserved("n1") == (600, 1280)  # r2 declares nothing: 100 m / 256 MB defaults
    assert view.env_run_by_node("e1") == {"n1": 1, "n2": 1}
    stop = pb.Assignment()
    stop.CopyFrom(a1)
    stop.desired = pb.ASSIGNMENT_DESIRED_STOP
    await writer.commit(writer.txn().put(stop))
    assert view.reserved("n1") == (100, 256)
    assert view.env_run_by_node("e1") == {"n2": 1}
    await writer.commit(writer.txn().delete(K.key_of(a2)).delete(K.key_of(a3)))
    assert view.reserved("n1") == (0, 0)
    assert view.env_run_count("e1") == 0


async def test_release_arriving_after_its_assignment_fixes_the_reservation(view, writer):
    a = assignment("n1", "e1", "late")
    await writer.commit(writer.txn().create(a))
    assert view.reserved("n1") == (100, 256)
    await writer.commit(writer.txn().create(release("late", "e1", cpu=2000, mem=4096)))
    assert view.reserved("n1") == (2000, 4096)


async def test_listings_are_sorted_by_id(view, writer):
    for i in (3, 1, 2):
        await writer.commit(writer.txn().create(node(f"n{i}")))
    assert [n.meta.id for n in view.nodes()] == ["n1", "n2", "n3"]


async def test_view_converges_after_server_restart_and_resyncs(tmp_path):
    server = EmbeddedNats(data_dir=tmp_path / "nats").start()
    c = await connect(server.url, name="t")
    await provision(c.js)
    view = StateView(c, name="t")
    await view.start()
    writer = Writer(c, view)
    await writer.commit(writer.txn().create(node("n1")).create(node("n2")))
    feed = view.subscribe({K.NODE})
    feed.drain()

    # While this client is cut off, another one changes state.
    port = server.port
    server.stop()
    await eventually(lambda: view.stale, what="view marked stale on disconnect")
    server = EmbeddedNats(data_dir=tmp_path / "nats", port=port).start()
    other = await connect(server.url, name="other")
    other_view = StateView(other, name="other")
    await other_view.start()
    other_writer = Writer(other, other_view)
    await other_writer.commit(other_writer.txn().delete("node.n1").create(node("n3")))

    await view.wait_fresh(timeout=20)
    await eventually(lambda: view.node("n3") is not None and view.node("n1") is None, what="resynced")
    assert {("node", "n1"), ("node", "n3")} <= feed.drain()
    assert view.rev("node.n2") == other_view.rev("node.n2")
    await other_view.stop()
    await other.close()
    await view.stop()
    await c.close()
    server.stop()


async def test_garbage_over_a_valid_value_removes_it_as_a_fresh_view_would(conn, view: StateView, writer: Writer):
    await writer.commit(writer.txn().create(node("n1")))
    await eventually(lambda: view.node("n1") is not None, what="the node")
    await conn.js.publish(STATE_PREFIX + K.node("n1"), b"\xff\xfe\x00garbage")
    await eventually(lambda: view.skipped == 1, what="garbage counted")
    assert view.node("n1") is None
    assert view.skipped_by_kind == {K.NODE: 1}
    fresh = StateView(conn, name="fresh")
    await fresh.start()
    try:
        assert fresh.node("n1") is None
        assert fresh.rev(K.node("n1")) == view.rev(K.node("n1"))
    finally:
        await fresh.stop()
    await writer.commit(writer.txn().put(node("n1")))
    await eventually(lambda: view.node("n1") is not None, what="a fenced write replaces the garbage")


async def test_catch_up_waits_until_the_view_has_seen_every_stored_write(conn, view: StateView):
    other_view = StateView(conn, name="behind")
    await other_view.start()
    for i in range(20):
        await conn.js.publish(STATE_PREFIX + K.node(f"n{i}"), node(f"n{i}").SerializeToString())
    assert await other_view.catch_up(timeout=10)
    assert other_view.count(K.NODE) == 20
    await other_view.stop()
