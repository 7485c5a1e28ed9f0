"""Stopping helper tasks without swallowing our own cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from nats.aio.subscription import Subscription

RECANCEL_AFTER = 0.5
"""Seconds after which a task that is still running is cancelled again."""


async def cancel_and_wait(*tasks: asyncio.Future[object] | asyncio.Task[object] | None) -> None:
    """Cancel ``tasks`` and wait until they have finished.

    Awaiting a cancelled task inside ``suppress(CancelledError)`` would also swallow a cancellation of
    the *current* task that arrives meanwhile; this re-raises it, so a shutdown is never lost.
    """
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        # A task that swallowed its cancellation (nats-py does, inside a publish) gets it again.
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_AFTER)
    for finished in tasks:
        if finished is not None and finished.done() and not finished.cancelled():
            with contextlib.suppress(Exception):
                finished.exception()
    current = asyncio.current_task()
    if current is not None and current.cancelling():
        raise asyncio.CancelledError


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that a library swallowed: nats-py's publish flush absorbs a CancelledError
    that lands while it waits, but the task still counts the request (``cancelling()``). Without this a
    stopped leader term, or a shutdown, could keep running."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_following(task: asyncio.Task[None] | None, subscription: Any | None) -> None:
    """End a follower: cancel its task, then drop its NATS subscription (already gone with a lost connection)."""
    await cancel_and_wait(task)
    if subscription is not None:
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()


class Signal:
    """Wakes every task waiting at the time of :meth:`notify` (a missed notify is impossible as long as
    the waiter checks its condition and calls :meth:`wait` without yielding in between)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


async def serve_until_cancelled(ready: asyncio.Event, subscriptions: Sequence[Subscription]) -> None:
    """Set ``ready``, then let ``subscriptions`` serve until cancelled; they are unsubscribed then."""
    ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        for sub in subscriptions:
            await sub.unsubscribe()
