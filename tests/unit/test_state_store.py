"""The pure state store, filled directly: no NATS."""

from __future__ import annotations

import asyncio

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.state.reader import StateReader
from shared.state.store import StateStore
from tests.factories import assignment, node, release
from tests.memory_state import MemoryState


def test_a_snapshot_removes_what_it_lacks_and_tells_subscribers_exactly_what_changed() -> None:
    store = StateStore(name="t")
    store.apply_raw(K.node("n1"), 1, node("n1").SerializeToString())
    store.apply_raw(K.node("n2"), 2, node("n2").SerializeToString())
    feed = store.subscribe({K.NODE})
    store.apply_snapshot(
        {K.node("n2"): (2, node("n2").SerializeToString(), ""), K.node("n3"): (5, node("n3").SerializeToString(), "tp")}
    )
    assert [n.meta.id for n in store.nodes()] == ["n2", "n3"]
    assert feed.drain() == {(K.NODE, "n1"), (K.NODE, "n3")}
    assert store.last_revision == 5 and store.rev(K.node("n1")) == 0
    assert store.trace_headers(K.node("n3")) == {"traceparent": "tp"}


def test_garbage_is_skipped_counted_and_keeps_its_revision_for_a_fenced_write() -> None:
    store = StateStore(name="t")
    store.apply_raw(K.node("n1"), 1, node("n1").SerializeToString())
    store.apply_raw(K.node("n1"), 2, b"\xff\xfe garbage")
    store.apply_raw("weird.key", 3, b"x")
    assert store.node("n1") is None and store.rev(K.node("n1")) == 2
    assert store.skipped == 2 and store.skipped_by_kind == {K.NODE: 1, "unknown": 1}


def test_a_value_whose_own_id_names_another_key_is_garbage_too() -> None:
    """Readers act on the id inside a value (the VIP loop writes ``vip.<env.meta.id>``): one that disagrees
    with its key, e.g. random bytes that happen to decode, would have them write under a stray key."""
    store = StateStore(name="t")
    store.apply_raw(K.node("n1"), 1, node("n1").SerializeToString())
    store.apply_raw(K.node("n1"), 2, node("n1 *").SerializeToString())
    store.apply_raw(K.node("n2"), 3, node("n3").SerializeToString())
    assert store.nodes() == [] and store.rev(K.node("n1")) == 2 and store.rev(K.node("n2")) == 3
    assert store.skipped == 2 and store.skipped_by_kind == {K.NODE: 2}


def test_the_key_of_a_change_and_the_typed_reads() -> None:
    state = MemoryState(node("n1"), release("r1", "e1"))
    a = assignment("n1", "e1", "r1")
    state.put(a)
    state.observe("n1", a.meta.id, pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY))
    reader: StateReader = state.store
    assert reader.key_of(K.ASSIGNMENT, a.meta.id) == K.assignment("n1", a.meta.id)
    assert reader.key_of(K.NODE, "missing") is None
    joined = reader.assignment(a.meta.id)
    assert joined is not None and joined.observed.state == pb.INSTANCE_STATE_HEALTHY
    assert reader.reserved("n1") == (100, 256) and reader.env_run_count("e1") == 1
    state.delete(K.assignment("n1", a.meta.id))
    assert reader.assignments() == [] and reader.reserved("n1") == (0, 0)


async def test_a_revision_waiter_is_released_by_any_write_reaching_it_even_one_that_changes_nothing() -> None:
    store = StateStore(name="t")
    waiting = asyncio.ensure_future(store.wait_for_revision(2, timeout=10))
    store.apply_raw(K.node("n1"), 1, node("n1").SerializeToString())
    await asyncio.sleep(0)
    assert not waiting.done()
    store.apply_raw(K.node("gone"), 2, None)  # deleting a key it never held: nothing a change feed reports
    assert await waiting
    assert not await store.wait_for_revision(3, timeout=0)
