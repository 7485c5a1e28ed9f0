"""Fenced atomic writes on a real NATS server."""

from __future__ import annotations

import re

import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.lease import Lease
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.txn import Conflict, Deposed, Txn, Writer
from tests.factories import assignment, env, node, release
from tests.waiting import eventually


async def test_batch_with_one_conflicting_key_writes_no_key_at_all(conn, view: StateView, writer: Writer):
    await writer.commit(writer.txn().create(node("n1")))
    stale_rev = view.rev("node.n1")
    await writer.commit(writer.txn().put(node("n1", cpu=1)))  # someone else moved n1 on
    txn = Txn(view)
    txn.create(node("n2")).create(env("e1")).put(node("n1", cpu=2), expect=stale_rev)
    with pytest.raises(Conflict):
        await writer.commit(txn)
    fresh = StateView(conn, name="fresh")
    await fresh.start()
    assert fresh.node("n2") is None and fresh.env("e1") is None
    assert fresh.node("n1").capacity.cpu_millis == 1
    await fresh.stop()


@pytest.mark.parametrize("stray_id", ["", "a b", "a*", ">", "a\r\nPUB x 1"])
async def test_a_key_that_is_no_subject_is_refused_before_anything_is_sent(
    conn, view: StateView, writer: Writer, stray_id: str
):
    """Unchecked, an empty id (``vip.``) was dropped by the server and left the fenced batch incomplete,
    a space or line break broke off the batch in the client, and a wildcard became a key no read names."""
    txn = writer.txn().create(node("n1"))
    with pytest.raises(K.BadKey, match=re.escape(repr(K.vip(stray_id)))):
        txn.delete(K.vip(stray_id))
    await writer.commit(txn)  # the transaction is as it was: n1 only
    info = await conn.js.stream_info(STATE_STREAM)
    assert view.node("n1") is not None and info.state.messages == 1


async def test_create_of_an_existing_key_conflicts(view: StateView, writer: Writer):
    await writer.commit(writer.txn().create(node("n1")))
    with pytest.raises(Conflict):
        await writer.commit(writer.txn().create(node("n1")).create(node("n9")))
    assert view.node("n9") is None


async def test_revisions_applied_locally_equal_the_server_revisions(conn, view: StateView, writer: Writer):
    txn = writer.txn()
    for i in range(20):
        txn.create(node(f"n{i:02d}"))
    await writer.commit(txn)
    for i in range(20):
        key = f"node.n{i:02d}"
        msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + key, direct=True)
        assert msg.seq == view.rev(key)


async def test_delete_then_recreate_expects_the_tombstone(conn, view: StateView, writer: Writer):
    await writer.commit(writer.txn().create(node("n1")))
    await writer.commit(writer.txn().delete("node.n1"))
    assert view.node("n1") is None
    observer = StateView(conn, name="observer")
    await observer.start()
    assert observer.node("n1") is None
    await writer.commit(writer.txn().put(node("n1", cpu=7), expect=await _server_rev(conn, "node.n1")))
    await eventually(lambda: observer.node("n1") is not None and observer.node("n1").capacity.cpu_millis == 7)
    await observer.stop()


async def _server_rev(conn, key: str) -> int:
    msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + key, direct=True)
    return int(msg.seq)


async def test_commit_many_isolates_the_conflicting_transaction(view: StateView, writer: Writer):
    await writer.commit(writer.txn().create(node("taken")))
    txns = [writer.txn().create(env(f"e{i}")) for i in range(10)]
    txns[6].create(node("taken"))
    results = await writer.commit_many(txns)
    assert [r is None for r in results] == [True] * 6 + [False] + [True] * 3
    assert isinstance(results[6], Conflict)
    assert view.env("e6") is None
    assert all(view.env(f"e{i}") is not None for i in range(10) if i != 6)


async def test_concurrent_commits_are_group_committed_and_each_stays_atomic(view: StateView, writer: Writer):
    import asyncio

    await writer.commit(writer.txn().create(node("taken")))

    async def one(i: int) -> bool:
        txn = writer.txn().create(env(f"e{i}")).create(release(f"r{i}", f"e{i}"))
        if i % 7 == 0:
            txn.create(node("taken"))
        try:
            await writer.commit(txn)
            return True
        except Conflict:
            return False

    ok = await asyncio.gather(*(one(i) for i in range(50)))
    for i, committed in enumerate(ok):
        assert committed == (i % 7 != 0)
        assert (view.env(f"e{i}") is not None) == committed
        assert (view.release(f"r{i}") is not None) == committed


async def test_a_deposed_leaders_batch_is_refused_by_the_server(conn, view: StateView):
    first = Lease(conn, "scheduler", "first", ttl=30)
    second = Lease(conn, "scheduler", "second", ttl=30)
    assert await first.try_acquire()
    assert not await second.try_acquire()
    fenced = Writer(conn, view, lease=first)
    await fenced.commit(fenced.txn().create(node("n1")))

    # The first holder stalls; its lease vanishes (as on TTL expiry) and the second takes over.
    await conn.js.publish(STATE_PREFIX + "lease.scheduler", b"", headers={"KV-Operation": "DEL"})
    assert await second.try_acquire()
    assert second.term > first.term

    with pytest.raises(Deposed):
        await fenced.commit(fenced.txn().create(node("n2")).put(node("n1", cpu=1)))
    assert not first.held
    fresh = StateView(conn, name="fresh")
    await fresh.start()
    assert fresh.node("n2") is None
    assert fresh.node("n1").capacity.cpu_millis == 4000
    lease = fresh.lease("scheduler")
    assert lease.holder == "second" and lease.term == second.term
    await fresh.stop()


async def test_fenced_write_renews_the_lease(conn, view: StateView):
    lease = Lease(conn, "orchestrator", "me", ttl=30)
    assert await lease.try_acquire()
    before = lease.rev
    fenced = Writer(conn, view, lease=lease)
    await fenced.commit(fenced.txn().create(node("n1")))
    assert lease.rev > before
    assert await lease.renew()


async def test_assignment_desired_and_observed_keys_are_separate(conn, view: StateView, writer: Writer):
    a = assignment("n1", "e1", "r1")
    await writer.commit(writer.txn().create(a))
    obs = pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY, container_id="c1")
    await writer.commit(writer.txn().put(obs, key=K.observed("n1", a.meta.id)))
    await eventually(lambda: view.assignment(a.meta.id).observed.state == pb.INSTANCE_STATE_HEALTHY)
    # the scheduler rewriting the desired part leaves the observed part alone
    stop = pb.Assignment()
    stop.CopyFrom(view.assignment(a.meta.id))
    stop.desired = pb.ASSIGNMENT_DESIRED_STOP
    await writer.commit(writer.txn().put(stop))
    assert view.assignment(a.meta.id).observed.state == pb.INSTANCE_STATE_HEALTHY
    raw = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.assignment("n1", a.meta.id), direct=True)
    assert not pb.Assignment.FromString(raw.data).HasField("observed")
