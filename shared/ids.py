"""Identifiers: ULIDs for what is named and kept (26 characters, Crockford base32, sortable by creation time), and
cheap unique ids for what only needs telling apart (a publish's dedupe id)."""

from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ulid import ULID

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

_lock = threading.Lock()
_last: ULID | None = None  # the ULID library is imported by the first id minted (a CLI read mints none)


def new_id() -> str:
    """A new ULID, strictly increasing within this process (monotonic even within one millisecond)."""
    from ulid import ULID

    global _last
    with _lock:
        candidate = ULID()
        if _last is not None and candidate.bytes <= _last.bytes:
            candidate = ULID.from_int(int(_last) + 1)
        _last = candidate
        return str(candidate)


def message_id() -> str:
    """A publish's dedupe id (``Nats-Msg-Id``, ``Nats-Batch-Id``): 96 random bits, not sortable. About 0.3 µs,
    where a ULID costs several (the state write path mints one per write). Unguessable: the duplicate window spans
    the whole stream, so a writer that could predict another's next id could have that write dropped as a
    duplicate of its own."""
    return os.urandom(12).hex()


def is_safe_id(value: str) -> bool:
    """1-128 letters, digits, '-' or '_': usable as one path component and one NATS subject token.

    Every id the control plane mints is a ULID. A handler that turns an id from a request into a path (the
    agent's snapshot, restore and build handlers) refuses any other: ``..``, ``/`` or an absolute path would
    reach outside its data directory.
    """
    return _SAFE_ID.fullmatch(value) is not None


SAFE_ID_RULE = "1-128 letters, digits, '-' or '_'"


def unsafe_id(what: str, value: str) -> str:
    """The refusal message for an id that fails :func:`is_safe_id`."""
    return f"{what} {value[:64]!r} is not {SAFE_ID_RULE}"
