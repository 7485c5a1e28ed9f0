"""What the secrets service's delivery loops (a notification channel's, a log drain's) share: their status
records (``NotifyStatus``, ``LogDrainStatus``) read as the view holds them and written and waited for in the
view, the failure bookkeeping in them (FAILING after some failed attempts, recovered by a delivery), and the
follower that reads again after a fault."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from zattera.v1 import types_pb2 as pb

from shared.backoff import Backoff
from shared.clock import stamp
from shared.loop import LeaderLoop
from shared.txn import Deposed

log = logging.getLogger(__name__)

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


def record_failure(status: Status, error: str, now: float, failing_after: int) -> bool:
    """Count one failed delivery in ``status`` (the first of a row stamps ``failing_since``); True when this
    one makes it FAILING (``failing_after`` in a row), to be announced."""
    if status.failures == 0:
        stamp(status.failing_since, now)
    status.failures += 1
    status.last_error = error
    newly_failing = not status.failing and status.failures >= failing_after
    status.failing = status.failing or newly_failing
    return newly_failing


def clear_failures(status: Status) -> bool:
    """A delivery was accepted: the failures in ``status`` cleared; True when it was FAILING (it recovered)."""
    recovered = status.failing
    status.failing, status.failures, status.last_error = False, 0, ""
    status.ClearField("failing_since")
    return recovered


async def keep_following(
    loop: LeaderLoop, follow: Callable[[], Awaitable[None]], backoff: Backoff, what: str
) -> None:
    """Run ``follow`` for good: after a fault (a NATS one: a stream deleted, a consumer lost) it runs again
    after the ``backoff`` pause; a deposed leader stops. ``what`` names it in the log."""
    while True:
        try:
            await follow()
        except Deposed:
            raise
        except Exception as exc:
            log.warning("%s failed (%s); again shortly", what, type(exc).__name__)
            await loop.clock.sleep(next(backoff))
