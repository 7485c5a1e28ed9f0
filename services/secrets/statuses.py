"""The status records of the secrets service's delivery loops (a notification channel's ``NotifyStatus``, a log
drain's ``LogDrainStatus``): one read as the view holds it, one written and waited for in the view."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from zattera.v1 import types_pb2 as pb

from shared.clock import stamp
from shared.loop import LeaderLoop

Status = TypeVar("Status", pb.NotifyStatus, pb.LogDrainStatus)

SHOWN_WAIT = 10.0
"""Seconds the view may take to show one written status."""


def current_status(loop: LeaderLoop, kind: str, record: type[Status], name: str) -> Status:
    """A copy of status ``name`` as the view holds it (an empty one when it has none), to change and save."""
    found = loop.view.get(kind, name)
    status = record()
    if isinstance(found, record):
        status.CopyFrom(found)
    status.meta.id = name
    return status


async def save_status(loop: LeaderLoop, kind: str, status: Status) -> None:
    """Write ``status`` (stamped now) through the loop's fenced writer and wait until the view shows it (the
    next write expects it)."""
    assert loop.writer is not None
    stamp(status.meta.updated_at, loop.clock.now())
    written = type(status)()
    written.CopyFrom(status)
    feed = loop.view.subscribe({kind})
    try:
        await loop.writer.commit(loop.writer.txn(loop.name).put(written))
        while loop.view.get(kind, written.meta.id) != written:
            await asyncio.wait_for(feed.wait(), SHOWN_WAIT)
    finally:
        feed.close()
