"""Injected time.

Loops never read the wall clock directly: they take a :class:`Clock` (now, sleep, timers; :func:`ticker`
for fixed-rate ticks). Production uses :class:`RealClock`; tests use :class:`FakeClock`, whose time moves
only when the test calls :meth:`FakeClock.advance`, so timer semantics are tested without sleeping on
real time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from typing import Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (UTC)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def timer(self, seconds: float) -> asyncio.Future[None]:
        """A future that completes ``seconds`` from now; cancelling it cancels the timer. Unlike a
        ``sleep`` wrapped in a task, it can be raced against other futures and dropped without a task
        to reap."""
        ...


async def ticker(clock: Clock, interval: float) -> AsyncIterator[float]:
    """Yield ``clock.now()`` every ``interval`` seconds at a fixed rate (ticks at start + k·interval, so
    the time spent by the consumer does not drift the schedule); ticks missed while the consumer was
    busy are skipped, not bunched."""
    if interval <= 0:
        raise ValueError(f"ticker interval must be positive, got {interval}")
    next_tick = clock.now() + interval
    while True:
        await clock.sleep(next_tick - clock.now())
        now = clock.now()
        yield now
        missed = (now - next_tick) // interval
        next_tick += (missed + 1) * interval


def to_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def stamp(field: Timestamp, epoch: float) -> Timestamp:
    """Set the protobuf ``field`` to ``epoch`` seconds, to the nearest nanosecond (truncating would turn
    ``1.000000003`` into ``…002``: floats rarely hold a decimal exactly), and return it."""
    field.FromNanoseconds(round(epoch * 1e9))
    return field


def parse_instant(text: str) -> float:
    """Epoch seconds from epoch seconds or ISO 8601 (``2026-12-02T17:00:00Z``, ``2026-12-02 17:00:00+01:00``;
    no zone = UTC). ValueError naming the text otherwise."""
    value = text.strip()
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time (ISO 8601, e.g. 2026-12-02T17:00:00Z, or epoch seconds)") from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def to_timestamp(epoch: float) -> Timestamp:
    """A new protobuf timestamp of ``epoch`` seconds (see :func:`stamp`)."""
    return stamp(Timestamp(), epoch)


def from_timestamp(field: Timestamp) -> float:
    """Epoch seconds of a protobuf timestamp (an unset one is 0.0)."""
    return field.ToNanoseconds() / 1e9


class RealClock:
    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def timer(self, seconds: float) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(max(0.0, seconds), _resolve, fut)
        fut.add_done_callback(lambda _: handle.cancel())
        return fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class FakeClock:
    """A clock that advances only when told to.

    ``sleep`` parks the caller until ``advance`` moves time past its deadline; sleepers wake
    in deadline order (ties in the order they slept), and ``advance`` yields to the event loop
    after each wake-up so woken tasks run before time moves on.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        await self.timer(seconds)

    def timer(self, seconds: float) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if seconds <= 0:
            fut.set_result(None)
            return fut
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        return fut

    @property
    def sleepers(self) -> int:
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline is reached, in order."""
        target = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
                for _ in range(5):
                    await asyncio.sleep(0)
        self._now = target
        for _ in range(5):
            await asyncio.sleep(0)

    def set(self, ts: float) -> None:
        self._now = ts


async def wait_or_timer(clock: Clock, awaitable: Awaitable[object], seconds: float | None) -> bool:
    """Wait for ``awaitable`` or until ``seconds`` have passed on ``clock`` (None: no limit), whichever comes
    first; True when ``awaitable`` finished. What is still pending is cancelled."""
    waiting: asyncio.Future[object] = asyncio.ensure_future(awaitable)
    timer = clock.timer(seconds) if seconds is not None else None
    waiters: set[asyncio.Future[Any]] = {waiting}
    if timer is not None:
        waiters.add(timer)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if timer is not None:
            timer.cancel()
    return waiting.done() and not waiting.cancelled()
