"""What JetStream says in error codes and headers, named once for every reader and writer.

- :data:`WRONG_LAST_SEQUENCE`: the API error code of a write whose expected last (subject) sequence did
  not hold: someone else wrote first (a compare-and-set lost; ``shared/txn.py``'s ``Conflict``).
- :func:`is_delete_marker`: a stream message that records a key's deletion rather than a value: a KV
  ``DEL``/``PURGE`` operation, or a marker the server left when a per-message TTL expired
  (``Nats-Marker-Reason``).
"""

from __future__ import annotations

from collections.abc import Mapping

WRONG_LAST_SEQUENCE = 10071
DELETE_OPERATIONS = frozenset(("DEL", "PURGE"))


def is_delete_marker(headers: Mapping[str, str] | None) -> bool:
    if not headers:
        return False
    return headers.get("KV-Operation") in DELETE_OPERATIONS or "Nats-Marker-Reason" in headers
