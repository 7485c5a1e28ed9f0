"""What JetStream says in error codes and headers, named once for every reader and writer, and the one
point read of a key.

- :data:`WRONG_LAST_SEQUENCE`: the API error code of a write whose expected last (subject) sequence did
  not hold: someone else wrote first (a compare-and-set lost; ``shared/txn.py``'s ``Conflict``).
- :func:`is_delete_marker`: a stream message that records a key's deletion rather than a value: a KV
  ``DEL``/``PURGE`` operation, or a marker the server left when a per-message TTL expired
  (``Nats-Marker-Reason``).
- :func:`read_last` / :func:`read_state_key`: a key's last message by a direct get (any replica answers;
  the read an agent's credential may make of its own keys), with one rule for what counts as absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

WRONG_LAST_SEQUENCE = 10071
DELETE_OPERATIONS = frozenset(("DEL", "PURGE"))


def is_delete_marker(headers: Mapping[str, str] | None) -> bool:
    if not headers:
        return False
    return headers.get("KV-Operation") in DELETE_OPERATIONS or "Nats-Marker-Reason" in headers


@dataclass(frozen=True, slots=True)
class LastMessage:
    revision: int
    """The stream sequence of the subject's last message, a delete marker included (the revision a
    compare-and-set of the key must expect); 0 when there is none."""
    data: bytes | None
    """None when the key is absent: never written, deleted, expired (a delete marker) or empty."""


async def read_last(js: JetStreamContext, stream: str, subject: str) -> LastMessage:
    """The last message of ``subject`` in ``stream``. NATS errors other than "none" propagate."""
    try:
        msg = await js.get_last_msg(stream, subject, direct=True)
    except NotFoundError:
        return LastMessage(0, None)
    revision = int(msg.seq or 0)
    if is_delete_marker(msg.headers) or not msg.data:
        return LastMessage(revision, None)
    return LastMessage(revision, bytes(msg.data))


async def read_state_key(js: JetStreamContext, key: str) -> LastMessage:
    """The state bucket's last message of ``key`` (``node.n1``, ``build.B``…)."""
    from shared.subjects import STATE_PREFIX, STATE_STREAM

    return await read_last(js, STATE_STREAM, STATE_PREFIX + key)
