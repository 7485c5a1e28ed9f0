"""The one point read of a state key (shared/jetstream.py read_state_key) on real NATS: absent, written,
deleted — a deletion is absent but keeps its revision, the one a compare-and-set must expect."""

from __future__ import annotations

from shared import keys as K
from shared.connection import Connection
from shared.jetstream import read_state_key
from shared.state.feed import StateView
from shared.txn import Writer
from tests.factories import node


async def test_a_key_reads_absent_written_then_deleted(conn: Connection, view: StateView, writer: Writer) -> None:
    never = await read_state_key(conn.js, K.node("n1"))
    assert (never.revision, never.data) == (0, None)
    await writer.commit(writer.txn().create(node("n1")))
    written = await read_state_key(conn.js, K.node("n1"))
    assert written.revision == view.rev(K.node("n1")) > 0
    assert written.data is not None and K.decode(K.NODE, written.data) == view.node("n1")
    await writer.commit(writer.txn().delete(K.node("n1")))
    deleted = await read_state_key(conn.js, K.node("n1"))
    assert deleted.data is None and deleted.revision > written.revision
