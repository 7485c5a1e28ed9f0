"""Wait on a condition with a timeout (never a bare sleep standing in for a timer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.js.errors import NoStreamResponseError

T = TypeVar("T")


async def eventually(cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {what or cond}")
        await asyncio.sleep(0.01)


def eventually_sync(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """:func:`eventually` for synchronous tests (e.g. ones driving the CLI, which runs its own event loop)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {what or cond}")
        time.sleep(0.05)


class BlocksUntilCancelled:
    """A coroutine function (any arguments) that waits forever, telling when it started and when it was
    cancelled: what a test hands to code that must stop work under way."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, *_: object) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def retried(
    call: Callable[[], Awaitable[T]], errors: tuple[type[Exception], ...], timeout: float = 10.0, pause: float = 0.05
) -> T:
    """``call()``, made again while it raises one of ``errors`` (a stream or a service not reached yet), until
    ``timeout``; then its error stands."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except errors:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(pause)


async def published(js: JetStreamContext, subject: str, payload: bytes, timeout: float = 10.0) -> PubAck:
    """A JetStream publish sent again while no stream answers: in a cluster, a stream just created on one
    server is not reached from a client of another for some milliseconds ("no responders": nothing stored)."""
    return await retried(lambda: js.publish(subject, payload), (NoStreamResponseError,), timeout)
