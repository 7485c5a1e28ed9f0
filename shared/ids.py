"""ULID identifiers: 26 characters, Crockford base32, sortable by creation time."""

from __future__ import annotations

import threading

from ulid import ULID

_lock = threading.Lock()
_last = ULID()


def new_id() -> str:
    """A new ULID, strictly increasing within this process (monotonic even within one millisecond)."""
    global _last
    with _lock:
        candidate = ULID()
        if candidate.bytes <= _last.bytes:
            candidate = ULID.from_int(int(_last) + 1)
        _last = candidate
        return str(candidate)
