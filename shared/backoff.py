"""Exponential backoff, and retrying an action with it until it succeeds or the process is told to stop.

One shape for what a process does before it can work: connect to NATS, wait for provisioning, join the
cluster. Each attempt that fails with an expected error is logged with the delay before the next one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shared.clock import Clock, RealClock, wait_or_timer

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_DELAY = 0.2
MOST_DELAY = 5.0


def exponential(first: float, attempt: int, most: float) -> float:
    """``first · 2^(attempt-1)`` seconds, at most ``most``: ``first`` before the first retry (attempt 1)."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return min(first * 2.0 ** min(attempt - 1, 64), most)


async def retry_until_stopped(
    attempt: Callable[[], Awaitable[T]],
    stop: asyncio.Event | None,
    *,
    what: str,
    retry_on: tuple[type[Exception], ...] = (Exception,),
    never_on: tuple[type[Exception], ...] = (),
    first: float = FIRST_DELAY,
    most: float = MOST_DELAY,
    level: int = logging.WARNING,
    clock: Clock | None = None,
) -> T | None:
    """``attempt()``'s result, retried with exponential backoff while it raises one of ``retry_on`` (but not
    ``never_on``: retrying cannot help); None once ``stop`` is set (None: never). Each failure is logged as
    ``<what> (<error>); retrying in <delay>s``."""
    clock = clock or RealClock()
    failures = 0
    while stop is None or not stop.is_set():
        try:
            return await attempt()
        except never_on:
            raise
        except retry_on as exc:
            failures += 1
            delay = exponential(first, failures, most)
            log.log(level, "%s (%s); retrying in %.1fs", what, str(exc) or type(exc).__name__, delay)
        if stop is None:
            await clock.sleep(delay)
        else:
            await wait_or_timer(clock, stop.wait(), delay)
    return None


async def retry_until_done(action: Callable[[], Awaitable[object]], stop: asyncio.Event | None, **options: Any) -> bool:
    """:func:`retry_until_stopped` for an action whose result does not matter: True once it succeeded, False
    once ``stop`` is set."""

    async def done() -> bool:
        await action()
        return True

    return bool(await retry_until_stopped(done, stop, **options))
