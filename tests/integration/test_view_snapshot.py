"""A view loaded from one direct-get snapshot (the CLI's, docs/cluster.md) holds what a consumer-loaded view
holds: the last value of every key, deletes applied, the same revisions."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Conflict, Writer


def node(node_id: str, name: str = "") -> pb.Node:
    n = pb.Node(name=name or node_id)
    n.meta.id = node_id
    return n


async def test_a_snapshot_view_matches_a_consumer_view_and_reloads_after_a_conflict(
    conn: Connection, view: StateView, writer: Writer
) -> None:
    await writer.commit(writer.txn().put(node("n1")).put(node("n2")).put(node("n3")))
    await writer.commit(writer.txn().put(node("n1", "renamed")).delete(K.key_of(node("n3"))))

    snapshot = StateView(conn, name="snapshot")
    await snapshot.load_snapshot(timeout=5)

    assert sorted((n.meta.id, n.name) for n in snapshot.nodes()) == [("n1", "renamed"), ("n2", "n2")]
    assert {k: snapshot.rev(k) for k in ("node.n1", "node.n2")} == {k: view.rev(k) for k in ("node.n1", "node.n2")}

    # It follows no changes by itself: a write it conflicts with reloads it, so the caller re-decides on it.
    stale = Writer(conn, snapshot)
    await writer.commit(writer.txn().put(node("n2", "moved on")))
    try:
        await stale.commit(stale.txn().put(node("n2", "stale decision")))
        raise AssertionError("a write on a stale revision landed")
    except Conflict:
        pass
    n2 = snapshot.node("n2")
    assert n2 is not None and n2.name == "moved on"
    await snapshot.stop()
