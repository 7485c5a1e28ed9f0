"""The shape every leader loop shares: a full pass at the start of a term, on relevant changes
(coalesced), at the loop's own deadlines and at least every tick; writes go through a writer fenced by
the term's lease.

A concrete loop implements :meth:`LeaderLoop.run_pass` (feed ``evaluate()`` from the view, commit the
decisions with :meth:`LeaderLoop.commit_decisions`) and may refine the term through hooks, never by
overriding :meth:`LeaderLoop.run`:

* :attr:`kinds`: the view kinds that wake it; :meth:`extra_feeds`: further change feeds (e.g. live
  samples) subscribed for the term;
* :meth:`scope_of`: what a change-woken pass must look at (everything, some ids for
  :meth:`run_partial_pass`, or nothing: keep waiting);
* :meth:`seconds_until_due`: a deadline of the loop's own (a timer of the injected clock, as the tick);
* :meth:`on_term_start` resets in-memory timers (a new term starts from durable state); :meth:`begin_term` /
  :meth:`end_term` start and stop what the loop runs beside its passes for one term.

Tracing: a pass woken by changes continues the trace of the newest triggering write that carried one
(its ``traceparent``, kept by the view), so a deploy started by the CLI can be followed through every loop
that reacted to it; a pass woken by the tick alone starts a trace of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from zattera.v1 import types_pb2 as pb

from shared.clock import Clock
from shared.connection import Connection
from shared.decision import Decision
from shared.events import EventPublisher
from shared.lease import Leadership
from shared.metrics import loop_pass_duration
from shared.settings import DEFAULTS
from shared.state.changes import Change, ChangeFeed
from shared.state.feed import StateView
from shared.tasks import raise_if_cancelling
from shared.telemetry import span
from shared.txn import Deposed, Writer

log = logging.getLogger(__name__)

Scope = frozenset[str] | None
"""What a change-woken pass looks at: None = everything (a full pass), ids = only those, empty = nothing."""
FULL: Scope = None


async def wait_for_changes(feeds: Sequence[ChangeFeed], clock: Clock, timeout: float) -> set[Change] | None:
    """The changes of whichever feeds fire first (an empty set: a feed was poked), or None when
    ``timeout`` of ``clock`` elapses first."""
    if timeout <= 0:
        return None
    timer = clock.timer(timeout)
    waiters = [asyncio.ensure_future(feed.wait()) for feed in feeds]
    try:
        racing: list[asyncio.Future[Any]] = [timer, *waiters]
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        for waiter in waiters:
            waiter.cancel()
        results = await asyncio.gather(*waiters, return_exceptions=True)
    received = [result for result in results if isinstance(result, set)]
    if not received:
        return None
    changes: set[Change] = set()
    for batch in received:
        changes |= batch
    return changes


@dataclass(frozen=True, slots=True)
class LoopDeps:
    """What every leader loop receives from its service (``ServiceContext.loop_deps``; tests build one)."""

    conn: Connection
    view: StateView
    clock: Clock
    coalesce: float = DEFAULTS.coalesce_window
    """Seconds a loop waits after a pass so that a burst of changes wakes one pass, not many."""
    max_batch: int = DEFAULTS.max_batch
    """Most writes in one atomic batch of the fenced writer."""
    tombstone_ttl: float = DEFAULTS.tombstone_ttl
    """Seconds a delete marker outlives the key it deleted."""


class LeaderLoop(ABC):
    """Base of the leader-gated loops. Subclasses set :attr:`name` (the lease) and :attr:`kinds`."""

    name: str = ""
    kinds: frozenset[str] = frozenset()

    def __init__(self, deps: LoopDeps, *, tick: float = DEFAULTS.loop_tick) -> None:
        self.deps = deps
        self.conn = deps.conn
        self.view = deps.view
        self.clock = deps.clock
        self.tick = tick
        self.coalesce = deps.coalesce
        self.events = EventPublisher(deps.conn)
        self.writer: Writer | None = None
        self.passes = 0
        self._feeds: list[ChangeFeed] = []

    def fenced_writer(self, leadership: Leadership) -> Writer:
        return Writer(
            self.conn,
            self.view,
            lease=leadership.lease,
            max_batch=self.deps.max_batch,
            tombstone_ttl=self.deps.tombstone_ttl,
        )

    # ------------------------------------------------------------------ hooks

    def on_term_start(self) -> None:
        """Reset in-memory timers (a new term starts from durable state only)."""

    async def begin_term(self) -> None:
        """Start what runs beside the passes for this term (the view is fresh; before the first pass)."""

    async def end_term(self) -> None:
        """Stop what :meth:`begin_term` or the passes started (the term is over: lost, or cancelled)."""

    def extra_feeds(self) -> Sequence[ChangeFeed]:
        """Change feeds besides the view's (subscribed at the start of each term, closed at its end)."""
        return ()

    def scope_of(self, changes: set[Change]) -> Scope:
        """What a pass woken by ``changes`` must look at (default: everything)."""
        return FULL

    def seconds_until_due(self) -> float | None:
        """Seconds until a deadline of the loop's own falls due, to wake before the tick (None: no deadline)."""
        return None

    @abstractmethod
    async def run_pass(self) -> None:
        """One evaluation: read the view, decide, commit."""

    async def run_partial_pass(self, scope: frozenset[str]) -> None:
        """A pass over only what :meth:`scope_of` named (loops whose scope is never partial need none)."""
        raise NotImplementedError(f"{type(self).__name__} names a partial scope but runs no partial pass")

    # ------------------------------------------------------------------ the term

    async def run(self, leadership: Leadership) -> None:
        """Run for one leadership term (cancelled when the lease is lost): a full pass now, then one on
        every relevant change, deadline or tick; a partial pass when :meth:`scope_of` narrows a change."""
        self.writer = self.fenced_writer(leadership)
        self.on_term_start()
        self._feeds = [self.view.subscribe(set(self.kinds)), *self.extra_feeds()]
        try:
            await self.view.wait_fresh()
            await self.begin_term()
            full = True
            changes: set[Change] = set()
            while True:
                raise_if_cancelling()
                await self.view.wait_fresh()
                changes |= self._drain()
                scope = FULL if full else self.scope_of(changes)  # the changes since the wake-up count too
                if scope is FULL:
                    await self.pass_once(changes)
                    next_full = self.clock.now() + self.tick
                elif scope:
                    await self.partial_pass_once(scope)
                raise_if_cancelling()
                if self.coalesce:
                    await asyncio.sleep(self.coalesce)
                full, changes = await self._next_wake(next_full)
        finally:
            for feed in self._feeds:
                feed.close()
            self._feeds = []
            await self.end_term()

    def _drain(self) -> set[Change]:
        changes: set[Change] = set()
        for feed in self._feeds:
            changes |= feed.drain()
        return changes

    async def _next_wake(self, next_full: float) -> tuple[bool, set[Change]]:
        """Wait for the next pass: (True, nothing) when the tick or the loop's deadline is due (a full
        pass), (False, the changes) for changes :meth:`scope_of` does not ignore."""
        while True:
            if any(feed.pending_count for feed in self._feeds):
                changes: set[Change] | None = self._drain()
            else:
                due = next_full - self.clock.now()
                own = self.seconds_until_due()
                if own is not None:
                    due = min(due, max(own, 0.0))
                changes = await wait_for_changes(self._feeds, self.clock, due)
            if changes is None:
                return True, set()
            scope = self.scope_of(changes)
            if scope is FULL or scope:
                return False, changes

    # ------------------------------------------------------------------ passes

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
        changes = set(changes)
        for feed in self._feeds:
            feed.discard(changes)

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
            await self._guarded(self.run_pass())

    async def partial_pass_once(self, scope: frozenset[str]) -> None:
        self.passes += 1
        with span(f"{self.name}.pass", loop=self.name, passes=self.passes, scope=len(scope)), self.timed_pass():
            await self._guarded(self.run_partial_pass(scope))

    async def commit_decisions(self, writes: Sequence[Decision]) -> list[bool]:
        """Commit each non-empty :class:`Decision` atomically (packed into few batches) and publish the
        events of those that landed, in their order; one bool per input (an empty one counts as landed).
        A refused write is decided again on the next pass, which the conflicting change triggers;
        :class:`Deposed` propagates. Build the decisions right before (no await in between): their writes
        expect what was just read."""
        assert self.writer is not None, "a pass needs a writer (set by run(), or by the test)"
        pending = [(i, w) for i, w in enumerate(writes) if w]
        landed = [True] * len(writes)
        if not pending:
            return landed
        results = await self.writer.commit_many([w.txn(self.writer) for _, w in pending])
        announced: list[pb.Event] = []
        for (i, w), error in zip(pending, results, strict=True):
            if error is not None:
                landed[i] = False
                log.info("%s: %s not written (%s); re-deciding on the next pass", self.name, w.label, error)
            else:
                announced.extend(w.events)
        await self.events.publish(*announced)  # together: a pass of 1,000 writes is one round trip
        raise_if_cancelling()
        return landed

    async def _guarded(self, evaluation: Awaitable[None]) -> None:
        """Run a pass; a failure is logged and retried by the next wake-up (a lost lease ends the term)."""
        try:
            await evaluation
        except Deposed:
            raise
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: pass failed; will retry on the next change or tick", self.name)
