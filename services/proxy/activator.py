"""Hold-and-activate: requests for a cold or full env wait here while the control plane wakes it.

A request for a scaled-to-zero env with no endpoint (cold), or for an env whose endpoints are all at
``max_concurrency`` (full), is held here until its ``select`` callback finds an endpoint. Holding:

1. a declared ``Content-Length`` above the body cap (10 MiB) → 503 "request too large during cold
   start". Bodies are never buffered while held: they wait in the socket under flow control, so a
   chunked body needs no cap;
2. more than ``max_held_per_env`` (100) held for the env → 503 + ``Retry-After: 2``;
3. one activation per env at a time (single flight per proxy), detached from the request;
4. ``select`` is re-run whenever something that can make it succeed happens — a route snapshot
   arrives (:meth:`Holds.wake_all`) or a request of the env finishes (:meth:`Holds.wake_env`,
   capacity freed), not on a poll;
5. no endpoint within ``hold_timeout`` (60 s) → 504 "activation timed out".

A failed activation (timeout, no responder, "retry" error) is retried with backoff while requests are
still held, rather than leaving them to wait for the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TypeVar

from shared.backoff import Backoff
from shared.errors import ZatteraError
from shared.tasks import Signal, raise_if_cancelling

log = logging.getLogger(__name__)

MAX_HELD_PER_ENV = 100
HOLD_TIMEOUT = 60.0
MAX_HELD_BODY_BYTES = 10 * 1024 * 1024
QUEUE_FULL_RETRY_AFTER = "2"
ACTIVATE_RETRY_INITIAL = 0.5
ACTIVATE_RETRY_MAX = 5.0

T = TypeVar("T")
Activate = Callable[[str], Awaitable[object]]
"""Asks the control plane to wake an env; raises when the request must be retried."""


class HoldRejected(ZatteraError):
    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False)
class Holds:
    activate: Activate
    _: KW_ONLY
    max_held_per_env: int = MAX_HELD_PER_ENV
    hold_timeout: float = HOLD_TIMEOUT
    max_body_bytes: int = MAX_HELD_BODY_BYTES
    retry_initial: float = ACTIVATE_RETRY_INITIAL
    retry_max: float = ACTIVATE_RETRY_MAX
    activations_sent: int = field(init=False, default=0)
    completed_holds: int = field(init=False, default=0)
    _held: dict[str, int] = field(init=False, default_factory=dict)
    _signals: dict[str, Signal] = field(init=False, default_factory=dict)
    _activations: dict[str, asyncio.Task[None]] = field(init=False, default_factory=dict)
    _closed: bool = field(init=False, default=False)

    @property
    def held(self) -> dict[str, int]:
        """Env id → requests held now (envs with none are absent)."""
        return self._held

    def wake_all(self) -> None:
        for signal in self._signals.values():
            signal.notify()

    def wake_env(self, env_id: str) -> None:
        signal = self._signals.get(env_id)
        if signal is not None:
            signal.notify()

    async def hold(
        self, env_id: str, content_length: int | None, select: Callable[[], T | None], *, timeout: float | None = None
    ) -> T:
        """Wait until ``select()`` returns a value and return it; raises :class:`HoldRejected`. ``timeout``:
        what is left of this request's hold (default: the whole ``hold_timeout``)."""
        if self._closed:
            raise HoldRejected(503, "proxy shutting down", "1")
        if content_length is not None and content_length > self.max_body_bytes:
            raise HoldRejected(503, "request too large during cold start")
        if self._held.get(env_id, 0) >= self.max_held_per_env:
            raise HoldRejected(503, "activating; queue full, retry shortly", QUEUE_FULL_RETRY_AFTER)
        self._held[env_id] = self._held.get(env_id, 0) + 1
        signal = self._signals.setdefault(env_id, Signal())
        try:
            self._trigger(env_id)
            async with asyncio.timeout(max(0.0, self.hold_timeout if timeout is None else timeout)):
                while True:
                    if self._closed:
                        raise HoldRejected(503, "proxy shutting down", "1")
                    chosen = select()
                    if chosen is not None:
                        self.completed_holds += 1
                        return chosen
                    await signal.wait()
        except TimeoutError:
            raise HoldRejected(504, "activation timed out") from None
        finally:
            remaining = self._held[env_id] - 1
            if remaining:
                self._held[env_id] = remaining
            else:
                del self._held[env_id]
                del self._signals[env_id]

    def _trigger(self, env_id: str) -> None:
        running = self._activations.get(env_id)
        if running is None:
            task = asyncio.create_task(self._activate_while_held(env_id))
            self._activations[env_id] = task
            task.add_done_callback(lambda _: self._activations.pop(env_id, None))

    async def _activate_while_held(self, env_id: str) -> None:
        backoff = Backoff(self.retry_initial, self.retry_max)
        while True:
            self.activations_sent += 1
            delay = next(backoff)
            try:
                await self.activate(env_id)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise_if_cancelling()
                log.warning("activation of env %s failed (%s); retrying in %.1fs while held", env_id, exc, delay)
            await asyncio.sleep(delay)
            if not self._held.get(env_id):
                return

    async def close(self) -> None:
        """Reject every held request (503) and stop pending activations (shutdown)."""
        self._closed = True
        self.wake_all()
        tasks = list(self._activations.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
