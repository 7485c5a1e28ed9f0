"""A new record's ``meta``: its id and its created and updated times.

Every writer that mints a record (an app, an env, a deployment, a volume, a job, a sealed secret…) sets
them here, so that a new record always has both times, equal, to the nearest nanosecond.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.clock import stamp
from shared.ids import new_id

if TYPE_CHECKING:
    from zattera.v1 import types_pb2 as pb


def new_meta(meta: pb.Meta, now: float, record_id: str | None = None) -> str:
    """Give a new record's ``meta`` its id (``record_id``, else a new ULID) and its created and updated
    times (``now``, epoch seconds); returns the id."""
    meta.id = record_id or new_id()
    stamp(meta.created_at, now)
    stamp(meta.updated_at, now)
    return meta.id
