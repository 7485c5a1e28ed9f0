"""StateView: a :class:`shared.state.store.StateStore` kept in step with the ``zattera-state`` bucket.

The NATS side of the state (the store itself is pure):

* One JetStream ordered consumer over ``$KV.zattera-state.>`` (last value per subject, then every
  change), each delivered value applied to the store.
* On disconnect the view is marked stale; on reconnect it resyncs from scratch (diffing against what
  it had, so subscribers see exactly what changed) before :meth:`StateView.wait_fresh` returns again.
* Optional ``filters`` (key patterns such as ``assignment.<node>.*``, ``release.*``) restrict the view to
  those keys, for a client whose credential may read only them (a node agent, SECURITY.md): one *named*
  ordered consumer per filter, created with ``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``, the
  form a subject permission can scope. The view is in sync once every filter's consumer has delivered its
  last-per-subject backlog. Order holds per filter, not across them (a release may arrive after the
  assignment naming it): filters should not overlap. A named ordered consumer cannot be re-created
  under its name while the old one lives, so each consumer a resync or an ordered-consumer reset creates
  gets a fresh name; the old ones expire after :data:`FILTERED_INACTIVE_THRESHOLD`. Its
  :attr:`last_revision` is the newest revision of the filtered keys, so a writer's catch-up after an
  unknown outcome (:mod:`shared.txn`) ends in a resync of these keys rather than waiting for the stream's.
* With ``open_consumer`` (a secured agent, which may not create consumers: SECURITY.md) the view instead
  asks that callable for a consumer control created for it (last value per key of its filters, then every
  change) and pulls from it; each resync opens it anew.
* A resync never takes the view back in time: each of its consumers is an R1 consumer the cluster may
  place on any replica of the stream, and a follower can lag behind what the view's previous consumer
  (or a write of this process) already showed. The new load is applied only once it has delivered
  :attr:`StateView.seen_revision`, the newest revision of a key this view follows that it had applied,
  so the snapshot is never older than the view: an older one would keep the view's newer values of some
  keys beside older values of others (a promoted env beside its deployment still PENDING). A load that stays
  below it for :data:`LOAD_STALL` while the stream holds that revision (its replica is catching up) is thrown
  away and the view loads again, on a consumer the cluster may place elsewhere; one that cannot get there
  (the stream was restored below it, or :data:`MAX_FLOOR_MISSES` loads in a row stayed below) is applied.
* :meth:`StateView.catch_up`: the one way to wait until the view has seen every write the stream holds
  (after a conflict, so that a re-read sees the write that won), on the store's
  :meth:`~shared.state.store.StateStore.wait_for_revision`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
from google.protobuf.message import Message
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared.backoff import resubscribing
from shared.connection import Connection
from shared.directget import last_per_subject
from shared.jetstream import is_delete_marker
from shared.pull import PullFeed, PullLost
from shared.state.store import Snapshot, StateStore
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.tasks import cancel_and_wait, raise_if_cancelling

log = logging.getLogger(__name__)

INACTIVE_THRESHOLD = 300.0
FILTERED_INACTIVE_THRESHOLD = 60.0
"""A filtered view's replaced consumers (resync, ordered reset) linger this long after losing interest."""
LOAD_STALL = 10.0
"""A view load that receives nothing this long is started again (see :meth:`StateView._until_loaded`)."""
MAX_FLOOR_MISSES = 3
"""Loads in a row that stayed below the view's revision before one is applied as it is."""
SNAPSHOT_ATTEMPT = 0.5
"""A snapshot read (:meth:`StateView.load_snapshot`) silent this long is asked again at once."""
SNAPSHOT_PAUSE = 0.1
"""Pause before asking again when no replica answered a snapshot read."""
CONSUMER_HEARTBEAT = 1.0
"""Idle heartbeat of the view's ordered consumer: two missed (its server or its stream's leader lost) and
nats-py re-creates the consumer, every two beats until the stream answers (default 5 s: a view went deaf
for 10-20 s after a NATS server loss)."""


@dataclass
class _PullLoop:
    """The task pulling a pulled view's consumer (:class:`shared.pull.PullFeed`)."""

    task: asyncio.Task[None]

    async def unsubscribe(self) -> None:
        await cancel_and_wait(self.task)  # re-cancelled until it ends: the pull's wait_for can swallow one


class StateView(StateStore):
    """The live view of ``zattera-state``: the store, fed by the bucket; see the module docstring."""

    def __init__(
        self,
        conn: Connection,
        *,
        name: str = "view",
        filters: Sequence[str] = (),
        open_consumer: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        super().__init__(name=name)
        self._conn = conn
        self._open_consumer = open_consumer
        self._listening = False
        self._filters = tuple(filters)
        for pattern in self._filters:
            if not pattern or pattern.startswith(STATE_PREFIX) or ">" in pattern.split(".")[:-1]:
                raise ValueError(f"bad view filter {pattern!r}: a key pattern such as 'release.*'")
        self._synced = asyncio.Event()
        self._generation = 0
        self._subs: list[Any] = []
        self._loading: list[asyncio.Future[None]] = []
        self._resync_task: asyncio.Task[None] | None = None
        self._resync_buffer: Snapshot | None = None
        self._resync_floor = 0
        self._floor_reached = asyncio.Event()
        self._floor_misses = 0
        self.seen_revision = 0
        """The newest revision applied of a key this view's consumers deliver (see the module docstring)."""
        self._load_progress = 0.0
        self._snapshot_timeout = 0.0
        self._listening = False

    # ------------------------------------------------------------------ applying

    def apply_raw(self, key: str, rev: int, data: bytes | None, traceparent: str = "") -> None:
        super().apply_raw(key, rev, data, traceparent)
        self.seen_revision = max(self.seen_revision, rev)

    def apply_local(self, key: str, rev: int, msg: Message | None, traceparent: str = "") -> None:
        super().apply_local(key, rev, msg, traceparent)
        if rev > self.seen_revision and self._follows(key):
            self.seen_revision = rev

    def _follows(self, key: str) -> bool:
        """Whether this view's consumers deliver ``key`` (a filtered view does not see a write of another key)."""
        return not self._filters or any(key_matches(pattern, key) for pattern in self._filters)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = 30.0) -> None:
        """Subscribe and load the whole bucket; returns once the view is in sync. May be called again after
        it raised (e.g. while the consumer it pulls from cannot be opened yet)."""
        if not self._listening:
            self._listening = True
            self._conn.on_disconnect(self._on_disconnect)
            self._conn.on_reconnect(self._on_reconnect)
        await self._resync()
        await self.wait_fresh(timeout)

    async def load_snapshot(self, timeout: float) -> None:
        """Load the whole bucket once, without a consumer and without following changes: one direct get of
        the last value of every key (:func:`shared.directget.last_per_subject`), answered by any current
        replica, so it does not wait for a state stream leader (a one-shot reader such as the CLI; a
        NATS server loss costs it ~1.5 s instead of the election's 4–9 s). A request sent to a server that
        dies is never answered, so attempts are short and asked again at once. Raises
        :class:`TimeoutError` after ``timeout``, :class:`shared.directget.TooManySubjects` for a bucket too
        large for one direct get (use :meth:`start`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                msgs = await last_per_subject(self._conn.nc, STATE_STREAM, f"{STATE_PREFIX}>", SNAPSHOT_ATTEMPT)
                break
            except (TimeoutError, nats.errors.NoRespondersError, ConnectionError) as exc:
                if loop.time() >= deadline:
                    raise TimeoutError(f"view {self._name}: no snapshot within {timeout:.0f}s ({exc!r})") from None
                if not isinstance(exc, TimeoutError):
                    await asyncio.sleep(SNAPSHOT_PAUSE)
        snapshot: Snapshot = {}
        for msg in msgs:
            headers = msg.headers or {}
            key = headers.get("Nats-Subject", "")[len(STATE_PREFIX) :]
            data = None if is_delete_marker(headers) else msg.data
            snapshot[key] = (int(headers.get("Nats-Sequence", 0)), data, "")
        self.apply_snapshot(snapshot)
        self._synced.set()
        self._snapshot_timeout = timeout

    async def refresh_snapshot(self) -> None:
        """Load a snapshot-loaded view again (after a write conflict: it follows no changes by itself);
        nothing for a view that follows its stream."""
        if self._snapshot_timeout and not self._subs:
            await self.load_snapshot(self._snapshot_timeout)

    async def stop(self) -> None:
        self._generation += 1
        if self._resync_task:
            self._resync_task.cancel()
        await self._unsubscribe_all()

    async def _unsubscribe_all(self) -> None:
        # A resync still loading belongs to an older generation now: let it return instead of waiting forever.
        loading, self._loading = self._loading, []
        for done in loading:
            if not done.done():
                done.set_result(None)
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    @property
    def stale(self) -> bool:
        """Not in sync with the server (before the first load, or between a disconnect and the resync)."""
        return not self._synced.is_set()

    async def wait_fresh(self, timeout: float | None = None) -> None:
        """Wait until the view is in sync with the server (no loop decides on a stale view)."""
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def _on_disconnect(self) -> None:
        self._mark_stale()

    async def _on_reconnect(self) -> None:
        self._mark_stale()
        if self._resync_task is None or self._resync_task.done():
            self._resync_task = asyncio.create_task(self._resync_with_retry())

    async def force_resync(self) -> None:
        """Reload from the server now (after an unknown write outcome or a suspected gap)."""
        self._mark_stale()
        if self._resync_task is None or self._resync_task.done():
            self._resync_task = asyncio.create_task(self._resync_with_retry())
        await self._resync_task

    async def catch_up(self, timeout: float) -> bool:
        """Wait until the view has seen every write the state stream holds now (so that a re-read sees the
        write that made ours conflict); False when ``timeout`` passes first. A filtered view never reaches
        the stream's last revision: it waits the whole ``timeout``."""
        info = await self._conn.js.stream_info(STATE_STREAM)
        return await self.wait_for_revision(info.state.last_seq, timeout)

    def _mark_stale(self) -> None:
        self._synced.clear()

    async def _resync_with_retry(self) -> None:
        backoff = resubscribing()
        while True:
            try:
                await self._resync()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise_if_cancelling()  # nats-py may turn a cancellation into an error: it ends the retries
                delay = next(backoff)
                log.warning("view %s resync failed, retrying in %.1fs: %s", self._name, delay, exc)
                await asyncio.sleep(delay)

    async def _resync(self) -> None:
        """(Re)load every key with fresh ordered consumers (one per filter), then apply the difference."""
        self._mark_stale()
        self._generation += 1
        generation = self._generation
        await self._unsubscribe_all()
        self._resync_buffer = {}
        self._resync_floor = self.seen_revision
        self._floor_reached = asyncio.Event()
        if self._resync_floor == 0:
            self._floor_reached.set()
        loop = asyncio.get_running_loop()
        subjects = [STATE_PREFIX + pattern for pattern in self._filters] or [f"{STATE_PREFIX}>"]
        pulled = self._open_consumer is not None
        if pulled:
            subjects = [STATE_STREAM]  # one consumer, opened by control, covers every filter
        loaded: list[asyncio.Future[None]] = [loop.create_future() for _ in subjects]
        self._loading = loaded
        for subject, done in zip(subjects, loaded, strict=True):
            sub: Any = await (self._pull(generation, done) if pulled else self._subscribe(subject, generation, done))
            if generation != self._generation:  # a newer resync (or stop) took over meanwhile
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                return
            self._subs.append(sub)
            if pulled:
                continue  # the pull loop tells an empty load itself (its first, no-wait pull answers 404)
            info = await sub.consumer_info()
            # Judge emptiness by what the server has sent, not by what this client has processed yet: the
            # server may have pushed everything (num_pending 0) before the callback ran for the first one.
            if info.num_pending == 0 and server_delivered(info) == 0 and not done.done():
                done.set_result(None)
        await self._until_loaded(loaded)
        if generation != self._generation:
            return
        buffer, self._resync_buffer = self._resync_buffer, None
        self.apply_snapshot(buffer or {})
        self._synced.set()
        for feed in list(self._feeds):
            feed.poke()

    async def _until_loaded(self, loaded: list[asyncio.Future[None]]) -> None:
        """Wait for every consumer's initial load, then until the load has reached the revision the view had
        already seen (a consumer on a lagging replica catches up first). A load that receives nothing for
        ``LOAD_STALL`` seconds (its consumer lost with a NATS server mid-load) raises, and the caller resyncs
        from scratch — a large view still loading keeps receiving, so it is never cut short; a complete load
        that stays below that revision as long is applied (nothing more is coming: the message at that
        revision is gone)."""
        self._load_progress = time.monotonic()
        all_loaded = asyncio.gather(*loaded)
        while not all_loaded.done():
            await asyncio.wait({all_loaded}, timeout=1.0)
            if not all_loaded.done() and time.monotonic() - self._load_progress > LOAD_STALL:
                all_loaded.cancel()
                raise TimeoutError(f"view {self._name}: load stalled for {LOAD_STALL:.0f}s")
        all_loaded.result()
        reached = self._floor_reached
        while not reached.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reached.wait(), 1.0)
            if not reached.is_set() and time.monotonic() - self._load_progress > LOAD_STALL:
                self._floor_misses += 1
                if self._floor_misses < MAX_FLOOR_MISSES and await self._stream_holds(self._resync_floor):
                    raise TimeoutError(
                        f"view {self._name}: load stayed below revision {self._resync_floor} for "
                        f"{LOAD_STALL:.0f}s (its replica is catching up); loading again"
                    )
                log.warning(
                    "view %s: load stayed below revision %d for %.0fs (%d loads); applied as it is",
                    self._name,
                    self._resync_floor,
                    LOAD_STALL,
                    self._floor_misses,
                )
                break
        self._floor_misses = 0

    async def _stream_holds(self, revision: int) -> bool:
        """Whether the state stream has reached ``revision`` (so a load below it comes from a lagging
        replica); True when it cannot be asked (a credential without stream info): the load is retried, at
        most :data:`MAX_FLOOR_MISSES` times."""
        try:
            info = await self._conn.js.stream_info(STATE_STREAM)
        except Exception as exc:
            log.debug("view %s: stream info unavailable: %s", self._name, exc)
            return True
        return int(info.state.last_seq) >= revision

    async def _pull(self, generation: int, done: asyncio.Future[None]) -> _PullLoop:
        """Pull from the consumer control opened for this view (secured agents, :mod:`shared.security.views`)."""
        assert self._open_consumer is not None
        consumer = await self._open_consumer()

        def caught_up() -> None:
            if not done.done():
                done.set_result(None)  # nothing (more) to load

        feed = PullFeed(self._conn.nc, STATE_STREAM, consumer, self._on_message(generation, done), caught_up)

        async def pull_forever() -> None:
            try:
                await feed.run()
            except PullLost as exc:  # its consumer expired or was replaced, the server or connection was lost
                if generation == self._generation:
                    log.warning("view %s: pull stopped, resyncing: %s", self._name, exc)
                    self._mark_stale()
                    self._resync_task = asyncio.create_task(self._resync_with_retry())

        return _PullLoop(asyncio.create_task(pull_forever()))

    async def _subscribe(self, subject: str, generation: int, done: asyncio.Future[None]) -> Any:
        """One ordered consumer of ``subject``: last value per key, then every change."""
        on_msg = self._on_message(generation, done)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        if self._filters:
            config.name = self._consumer_name()
        sub = await self._conn.js.subscribe(
            subject,
            stream=STATE_STREAM,
            cb=on_msg,
            ordered_consumer=True,
            config=config,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1024 * 1024 * 1024,
            inactive_threshold=FILTERED_INACTIVE_THRESHOLD if self._filters else INACTIVE_THRESHOLD,
            idle_heartbeat=CONSUMER_HEARTBEAT,
        )
        guard_ordered_consumer(sub, self._consumer_name if self._filters else None)
        return sub

    def _on_message(self, generation: int, done: asyncio.Future[None]) -> Callable[[Msg], Awaitable[None]]:
        """The handler of one delivered key: buffered while (re)loading, applied afterwards."""

        async def on_msg(msg: Msg) -> None:
            if generation != self._generation:
                return
            try:
                meta = msg.metadata
                rev = meta.sequence.stream
                pending = meta.num_pending
            except Exception:
                return
            key = msg.subject[len(STATE_PREFIX) :]
            data = None if is_delete_marker(msg.headers) else msg.data
            traceparent = (msg.headers or {}).get("traceparent", "")
            if self._resync_buffer is not None:
                self._load_progress = time.monotonic()
                held = self._resync_buffer.get(key)
                if held is None or rev >= held[0]:
                    self._resync_buffer[key] = (rev, data, traceparent)
                if rev >= self._resync_floor:
                    self._floor_reached.set()
                if pending == 0 and not done.done():
                    done.set_result(None)
            else:
                self.apply_raw(key, rev, data, traceparent)

        return on_msg

    def _consumer_name(self) -> str:
        return f"{_NAME_UNSAFE.sub('_', self._name)[:40]}-{uuid.uuid4().hex[:16]}"


_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def key_matches(pattern: str, key: str) -> bool:
    """A key against a view filter (subject wildcards: ``*`` one token, a final ``>`` the rest)."""
    want, have = pattern.split("."), key.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)


def guard_ordered_consumer(sub: Any, new_name: Callable[[], str] | None) -> None:
    """Keep nats-py's ordered-consumer reset (a gap, missed heartbeats) alive through a NATS fault: an error
    raised by it (the connection reconnecting) would end the task that watches the heartbeats, and the view
    would never hear from the stream again; it is logged instead, and the next missed beats retry. With
    ``new_name`` (a named consumer) the re-created consumer gets a fresh name: under the old one the server
    would refuse it while the old consumer still exists."""
    jsi = getattr(getattr(sub, "_sub", None), "_jsi", None)
    reset = getattr(jsi, "reset_ordered_consumer", None)
    if jsi is None or reset is None or not hasattr(jsi, "_ccreq"):
        return

    async def guarded_reset(sseq: int | None) -> bool:
        if new_name is not None:
            jsi._ccreq.name = new_name()
        try:
            return bool(await reset(sseq))
        except Exception as exc:
            log.warning("view consumer reset failed (retried at the next missed heartbeats): %r", exc)
            return False

    jsi.reset_ordered_consumer = guarded_reset


def server_delivered(info: Any) -> int:
    delivered = getattr(info, "delivered", None)
    return int(getattr(delivered, "consumer_seq", 0) or 0)
