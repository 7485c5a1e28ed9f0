"""Ids: ULIDs strictly increasing within a process; a publish's dedupe id unique and not derivable from another."""

from __future__ import annotations

import itertools

from shared.ids import is_safe_id, message_id, new_id


def test_ulids_increase_even_within_one_millisecond() -> None:
    ids = [new_id() for _ in range(2_000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(len(i) == 26 and is_safe_id(i) for i in ids)


def test_dedupe_ids_are_unique_safe_and_share_no_prefix_a_counter_would_leave() -> None:
    ids = [message_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 24 and is_safe_id(i) for i in ids)
    # No shared process prefix: two random ids agree on their first 8 hex digits with odds of 2^-32.
    assert sum(a[:8] == b[:8] for a, b in itertools.pairwise(ids)) == 0
