"""The shape every leader loop shares: evaluate at the start of a term, on relevant view changes
(coalesced) and on a tick; write through a writer fenced by the term's lease.

A concrete loop implements :meth:`LeaderLoop.run_pass` (feed ``evaluate()`` from the view, commit the
decision). Its in-memory timers are reset by :meth:`LeaderLoop.on_term_start`, as in the reference.

Tracing: a pass woken by changes continues the trace of the newest triggering write that carried one
(its ``traceparent``, kept by the view), so a deploy started by the CLI can be followed through every loop
that reacted to it; a pass woken by the tick alone starts a trace of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from shared.clock import Clock
from shared.events import EventPublisher
from shared.lease import Leadership
from shared.metrics import loop_pass_duration
from shared.natsio import Connection
from shared.state.changes import Change, ChangeFeed
from shared.state.feed import StateView
from shared.tasks import raise_if_cancelling
from shared.telemetry import span
from shared.txn import Deposed, Writer

log = logging.getLogger(__name__)


async def wait_change_or_tick(
    view: StateView, feed_wait: asyncio.Future[set[Change]] | None, clock: Clock, tick: float
) -> None:
    """Return when the feed fires or the tick elapses (whichever first)."""
    timer = clock.timer(tick)
    waiters: set[asyncio.Future[object]] = {timer}  # type: ignore[arg-type]
    if feed_wait is not None:
        waiters.add(feed_wait)  # type: ignore[arg-type]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()


class LeaderLoop(ABC):
    """Base of the leader-gated loops. Subclasses set :attr:`name` (the lease) and :attr:`kinds`."""

    name: str = ""
    kinds: frozenset[str] = frozenset()

    def __init__(
        self,
        *,
        conn: Connection,
        view: StateView,
        clock: Clock,
        tick: float = 15.0,
        coalesce: float = 0.005,
        max_batch: int = 1000,
        tombstone_ttl: float = 900.0,
    ) -> None:
        self.conn = conn
        self.view = view
        self.clock = clock
        self.tick = tick
        self.coalesce = coalesce
        self.events = EventPublisher(conn)
        self._max_batch = max_batch
        self._tombstone_ttl = tombstone_ttl
        self.writer: Writer | None = None
        self.passes = 0
        self._feed: ChangeFeed | None = None

    def fenced_writer(self, leadership: Leadership) -> Writer:
        return Writer(
            self.conn, self.view, lease=leadership.lease, max_batch=self._max_batch, tombstone_ttl=self._tombstone_ttl
        )

    def on_term_start(self) -> None:
        """Reset in-memory timers (a new term starts from durable state only)."""

    def extra_kinds(self) -> Iterable[str]:
        return ()

    def seconds_until_due(self) -> float | None:
        """Seconds until a deadline of the loop's own falls due, to wake before the tick (None: no deadline)."""
        return None

    @abstractmethod
    async def run_pass(self) -> None:
        """One evaluation: read the view, decide, commit."""

    async def run(self, leadership: Leadership) -> None:
        """Run for one leadership term (cancelled when the lease is lost)."""
        self.writer = self.fenced_writer(leadership)
        self.on_term_start()
        feed = self._feed = self.view.subscribe(set(self.kinds) | set(self.extra_kinds()))
        changes: set[Change] = set()
        try:
            while True:
                raise_if_cancelling()
                await self.view.wait_fresh()
                changes |= feed.drain()
                await self.pass_once(changes)
                changes = set()
                raise_if_cancelling()
                if self.coalesce:
                    await asyncio.sleep(self.coalesce)
                if feed.pending_count:
                    continue
                waiter = asyncio.ensure_future(feed.wait())
                try:
                    due = self.seconds_until_due()
                    wait = self.tick if due is None else min(self.tick, max(due, 0.0))
                    await wait_change_or_tick(self.view, waiter, self.clock, wait)
                finally:
                    if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                        changes = waiter.result()
                    waiter.cancel()
        finally:
            feed.close()
            self._feed = None

    @contextmanager
    def timed_pass(self) -> Iterator[None]:
        """Record the pass's wall-clock duration (``zattera.loop.pass.duration``, label ``loop``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            loop_pass_duration.record(time.perf_counter() - started, {"loop": self.name})

    def ignore_own_changes(self, changes: Iterable[Change]) -> None:
        """Keep this loop's own writes of ``changes`` from waking it again (e.g. lease renewals)."""
        if self._feed is not None:
            self._feed.discard(changes)

    def trigger_trace(self, changes: Iterable[Change]) -> dict[str, str]:
        """The trace context of the newest write among ``changes`` that carried one (empty: none did)."""
        best_rev, best = 0, {}
        for kind, ident in changes:
            key = self.view.key_of(kind, ident)
            if key is None:
                continue
            headers = self.view.trace_headers(key)
            rev = self.view.rev(key)
            if headers and rev > best_rev:
                best_rev, best = rev, headers
        return best

    async def pass_once(self, changes: Iterable[Change] = ()) -> None:
        self.passes += 1
        parent = self.trigger_trace(changes) or None
        with span(f"{self.name}.pass", headers=parent, loop=self.name, passes=self.passes), self.timed_pass():
            try:
                await self.run_pass()
            except Deposed:
                raise
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: pass failed; will retry on the next change or tick", self.name)
