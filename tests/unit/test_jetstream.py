"""Delete markers, as every reader of a stream sees them (shared/jetstream.py)."""

from __future__ import annotations

import pytest

from shared.jetstream import is_delete_marker


@pytest.mark.parametrize(
    ("headers", "deleted"),
    [
        (None, False),
        ({}, False),
        ({"KV-Operation": "DEL"}, True),
        ({"KV-Operation": "PURGE"}, True),
        ({"Nats-Marker-Reason": "MaxAge"}, True),  # a per-message TTL expired
        ({"Nats-Msg-Id": "x"}, False),
        ({"KV-Operation": "PUT"}, False),
    ],
)
def test_delete_markers(headers: dict[str, str] | None, deleted: bool) -> None:
    assert is_delete_marker(headers) is deleted
