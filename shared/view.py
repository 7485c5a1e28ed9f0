"""StateView: an in-memory, indexed mirror of the ``zattera-state`` bucket.

Design:

* One JetStream ordered consumer over ``$KV.zattera-state.>`` (last value per subject, then every
  change). Each message is decoded by kind (:mod:`shared.keys`); an undecodable value or key is
  logged with its key, counted in :attr:`StateView.skipped` (per kind in ``skipped_by_kind`` and the
  ``zattera.view.skipped`` metric) and skipped; the view keeps working. Garbage written over a valid
  value removes that value, so the view agrees with one started afterwards.
* ``observed.<node>.<id>`` is joined into the matching assignment, so readers see
  ``Assignment.observed`` filled (the Kubernetes spec/status split). A RUNNING report does not
  downgrade HEALTHY/UNHEALTHY of the same container (the reference's merge rule).
* Indexes are maintained incrementally on every change: by kind, by environment, by node, per-node
  reservations of RUN assignments, and per-env/per-node RUN replica counts. Placement never rescans
  all assignments.
* Every entry keeps its revision (the stream sequence of its last write), which is what a fenced
  write expects (:mod:`shared.txn`). A writer applies its successful writes with
  :meth:`StateView.apply_local` (read-your-writes); the echo from the watch is then ignored.
* Changes are delivered to :class:`ChangeFeed` subscribers, coalesced per (kind, id), filtered by
  kind: a loop subscribes to what it reacts to, so its own lease renewals never wake it.
* On disconnect the view is marked stale; on reconnect it resyncs from scratch (diffing against what
  it had, so subscribers see exactly what changed) before :meth:`wait_fresh` returns again.
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

Messages handed out by the view are shared: callers must not mutate them (copy, then write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.natsio import STATE_PREFIX, STATE_STREAM, Connection, last_per_subject
from shared.pull import PullFeed, PullLost
from shared.tasks import cancel_and_wait
from shared.telemetry import counter

log = logging.getLogger(__name__)

RUN = pb.ASSIGNMENT_DESIRED_RUN
DEFAULT_CPU_MILLIS = 100
DEFAULT_MEMORY_MB = 256
_HEALTH_STATES = (pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY)
_DELETE_OPS = ("DEL", "PURGE")
INACTIVE_THRESHOLD = 300.0
FILTERED_INACTIVE_THRESHOLD = 60.0
"""A filtered view's replaced consumers (resync, ordered reset) linger this long after losing interest."""
LOAD_STALL = 10.0
"""A view load that receives nothing this long is started again (see :meth:`StateView._until_loaded`)."""
SNAPSHOT_ATTEMPT = 0.5
"""A snapshot read (:meth:`StateView.load_snapshot`) silent this long is asked again at once."""
SNAPSHOT_PAUSE = 0.1
"""Pause before asking again when no replica answered a snapshot read."""
CONSUMER_HEARTBEAT = 1.0
"""Idle heartbeat of the view's ordered consumer: two missed (its server or its stream's leader lost) and
nats-py re-creates the consumer, every two beats until the stream answers (default 5 s: a view went deaf
for 10-20 s after a NATS server loss)."""

UNKNOWN_KIND = "unknown"
"""The kind :attr:`StateView.skipped_by_kind` counts keys under that name no known kind."""
_skipped_counter = counter("zattera.view.skipped", "state values skipped because they could not be decoded")


def reservation(release: pb.Release | None) -> tuple[int, int]:
    """Per-replica reservation (cpu_millis, memory_mb): declared resources, defaults per zero dimension."""
    if release is None:
        return DEFAULT_CPU_MILLIS, DEFAULT_MEMORY_MB
    res = release.service.resources
    return res.cpu_millis or DEFAULT_CPU_MILLIS, res.memory_mb or DEFAULT_MEMORY_MB


def merge_observed(prev: pb.AssignmentObserved | None, new: pb.AssignmentObserved) -> pb.AssignmentObserved:
    """The reference's merge: a RUNNING report never downgrades HEALTHY/UNHEALTHY of the same container.

    A different container id means a new instance, whose RUNNING is real news and replaces the old state.
    """
    if (
        prev is not None
        and new.state == pb.INSTANCE_STATE_RUNNING
        and prev.state in _HEALTH_STATES
        and new.container_id == prev.container_id
    ):
        merged = pb.AssignmentObserved()
        merged.CopyFrom(new)
        merged.state = prev.state
        return merged
    return new


@dataclass(slots=True)
class Entry:
    msg: Message
    rev: int


Change = tuple[str, str]
"""(kind, id) of a changed object."""


class _HasFeeds(Protocol):
    _feeds: set[ChangeFeed]


class ChangeFeed:
    """Coalesced change notifications for a set of kinds (empty set = every kind)."""

    def __init__(self, owner: _HasFeeds, kinds: Iterable[str]) -> None:
        self._owner = owner
        self.kinds = frozenset(kinds)
        self._pending: set[Change] = set()
        self._signal = asyncio.Event()

    def _offer(self, kind: str, ident: str) -> None:
        if not self.kinds or kind in self.kinds:
            self._pending.add((kind, ident))
            self._signal.set()

    def poke(self) -> None:
        """Wake the consumer without a change (a resync or an explicit nudge)."""
        self._signal.set()

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def discard(self, changes: Iterable[Change]) -> None:
        """Forget pending changes (a loop's own writes that must not wake it again)."""
        before = len(self._pending)
        self._pending.difference_update(changes)
        if before and not self._pending:
            self._signal.clear()

    def drain(self) -> set[Change]:
        pending, self._pending = self._pending, set()
        self._signal.clear()
        return pending

    async def wait(self, timeout: float | None = None) -> set[Change]:
        """Wait for at least one change (or ``timeout``), then return and clear the pending set."""
        if not self._signal.is_set():
            if timeout is None:
                await self._signal.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._signal.wait(), timeout)
        return self.drain()

    def close(self) -> None:
        self._owner._feeds.discard(self)


@dataclass
class _Indexes:
    by_env: dict[str, dict[str, dict[str, Message]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict))
    )
    assignments_by_node: dict[str, dict[str, pb.Assignment]] = field(default_factory=lambda: defaultdict(dict))
    assignments_by_release: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    reserved: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    contribution: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    env_node_run: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    run_counted: dict[str, tuple[str, str]] = field(default_factory=dict)


_ENV_INDEXED = {
    K.RELEASE: "environment_id",
    K.DEPLOYMENT: "environment_id",
    K.ASSIGNMENT: "environment_id",
    K.VOLUME: "environment_id",
    K.BUILD: "environment_id",
    K.DOMAIN: "environment_id",
    K.SECRET: "environment_id",
    K.JOB: "environment_id",
}


@dataclass
class _PullLoop:
    """The task pulling a pulled view's consumer (:class:`shared.pull.PullFeed`)."""

    task: asyncio.Task[None]

    async def unsubscribe(self) -> None:
        await cancel_and_wait(self.task)  # re-cancelled until it ends: the pull's wait_for can swallow one


class StateView:
    """The in-memory view of ``zattera-state``; see the module docstring."""

    def __init__(
        self,
        conn: Connection | None = None,
        *,
        name: str = "view",
        filters: Sequence[str] = (),
        open_consumer: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self._conn = conn
        self._open_consumer = open_consumer
        self._name = name
        self._filters = tuple(filters)
        for pattern in self._filters:
            if not pattern or pattern.startswith(STATE_PREFIX) or ">" in pattern.split(".")[:-1]:
                raise ValueError(f"bad view filter {pattern!r}: a key pattern such as 'release.*'")
        self._items: dict[str, dict[str, Entry]] = {kind: {} for kind in K.ALL_KINDS}
        self._key_of: dict[tuple[str, str], str] = {}
        self._revs: dict[str, int] = {}
        self._traces: dict[str, tuple[int, str]] = {}
        self._observed: dict[tuple[str, str], pb.AssignmentObserved] = {}
        self._idx = _Indexes()
        self._feeds: set[ChangeFeed] = set()
        self._sorted_cache: dict[str, list[Any]] = {}
        self._synced = asyncio.Event()
        self._stale = True
        self._generation = 0
        self._subs: list[Any] = []
        self._loading: list[asyncio.Future[None]] = []
        self._resync_task: asyncio.Task[None] | None = None
        self._resync_buffer: dict[str, tuple[int, bytes | None]] | None = None
        self._load_progress = 0.0
        self.skipped = 0
        self.skipped_by_kind: Counter[str] = Counter()
        """Skipped values per key kind (:data:`UNKNOWN_KIND` for keys that name no kind)."""
        self.applied = 0
        self.last_revision = 0
        self._snapshot_timeout = 0.0
        self._kind_revisions: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = 30.0) -> None:
        """Subscribe and load the whole bucket; returns once the view is in sync."""
        assert self._conn is not None, "a view without a connection is fed with apply_* only"
        self._conn.on_disconnect(self._on_disconnect)
        self._conn.on_reconnect(self._on_reconnect)
        await self._resync()
        await self.wait_fresh(timeout)

    async def load_snapshot(self, timeout: float) -> None:
        """Load the whole bucket once, without a consumer and without following changes: one direct get of
        the last value of every key (:func:`shared.natsio.last_per_subject`), answered by any current
        replica, so it does not wait for a state stream leader (a one-shot reader such as the CLI; a
        NATS server loss costs it ~1.5 s instead of the election's 4–9 s). A request sent to a server that
        dies is never answered, so attempts are short and asked again at once. Raises
        :class:`TimeoutError` after ``timeout``, :class:`shared.natsio.TooManySubjects` for a bucket too
        large for one direct get (use :meth:`start`)."""
        assert self._conn is not None, "a view without a connection is fed with apply_* only"
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
        snapshot: dict[str, tuple[int, bytes | None]] = {}
        for msg in msgs:
            headers = msg.headers or {}
            key = headers.get("Nats-Subject", "")[len(STATE_PREFIX) :]
            snapshot[key] = (int(headers.get("Nats-Sequence", 0)), None if _is_delete(msg) else msg.data)
        self._apply_snapshot(snapshot)
        self._stale = False
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
    def filters(self) -> tuple[str, ...]:
        """The key patterns this view is restricted to (empty: the whole bucket)."""
        return self._filters

    @property
    def stale(self) -> bool:
        return self._stale

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
        if self._conn is None:
            return
        self._mark_stale()
        if self._resync_task is None or self._resync_task.done():
            self._resync_task = asyncio.create_task(self._resync_with_retry())
        await self._resync_task

    def _mark_stale(self) -> None:
        self._stale = True
        self._synced.clear()

    async def _resync_with_retry(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._resync()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("view %s resync failed, retrying in %.1fs: %s", self._name, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _resync(self) -> None:
        """(Re)load every key with fresh ordered consumers (one per filter), then apply the difference."""
        assert self._conn is not None
        self._mark_stale()
        self._generation += 1
        generation = self._generation
        await self._unsubscribe_all()
        self._resync_buffer = {}
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
        self._apply_snapshot(buffer or {})
        self._stale = False
        self._synced.set()
        for feed in list(self._feeds):
            feed.poke()

    async def _until_loaded(self, loaded: list[asyncio.Future[None]]) -> None:
        """Wait for every consumer's initial load; a load that receives nothing for ``LOAD_STALL`` seconds
        (its consumer lost with a NATS server mid-load) raises, and the caller resyncs from scratch — a
        large view still loading keeps receiving, so it is never cut short."""
        self._load_progress = time.monotonic()
        all_loaded = asyncio.gather(*loaded)
        while not all_loaded.done():
            await asyncio.wait({all_loaded}, timeout=1.0)
            if not all_loaded.done() and time.monotonic() - self._load_progress > LOAD_STALL:
                all_loaded.cancel()
                raise TimeoutError(f"view {self._name}: load stalled for {LOAD_STALL:.0f}s")
        all_loaded.result()

    async def _pull(self, generation: int, done: asyncio.Future[None]) -> _PullLoop:
        """Pull from the consumer control opened for this view (secured agents, :mod:`shared.security.views`)."""
        assert self._conn is not None and self._open_consumer is not None
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
        assert self._conn is not None
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
            data = None if _is_delete(msg) else msg.data
            if msg.headers and "traceparent" in msg.headers:
                self._note_trace(key, rev, msg.headers["traceparent"])
            if self._resync_buffer is not None:
                self._load_progress = time.monotonic()
                held = self._resync_buffer.get(key)
                if held is None or rev >= held[0]:
                    self._resync_buffer[key] = (rev, data)
                if pending == 0 and not done.done():
                    done.set_result(None)
            else:
                self._apply_raw(key, rev, data)

        return on_msg

    def _consumer_name(self) -> str:
        return f"{_NAME_UNSAFE.sub('_', self._name)[:40]}-{uuid.uuid4().hex[:16]}"

    def _apply_snapshot(self, snapshot: dict[str, tuple[int, bytes | None]]) -> None:
        present = {key for key, (_, data) in snapshot.items() if data is not None}
        for key in [k for k in self._revs if k not in present]:
            self._apply_raw(key, self._revs[key], None, force=True)
        for key, (rev, data) in sorted(snapshot.items(), key=lambda kv: kv[1][0]):
            self._apply_raw(key, rev, data)

    # ------------------------------------------------------------------ applying changes

    def _apply_raw(self, key: str, rev: int, data: bytes | None, *, force: bool = False) -> None:
        if not force and rev <= self._revs.get(key, 0) and data is not None:
            return
        self.last_revision = max(self.last_revision, rev)
        try:
            k = K.parse(key)
        except K.BadKey as exc:
            self._skip(key, rev, exc, kind=UNKNOWN_KIND)
            return
        self._note_kind_revision(k.kind, rev)
        if data is None:
            self._remove(k, key)
            return
        try:
            msg = K.decode(k.kind, data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            # The key's value is now garbage: forget the previous one, as a view started now would
            # never have seen it, and keep the revision so that a fenced write can replace it.
            self._remove(k, key)
            self._skip(key, rev, exc, kind=k.kind)
            return
        self._revs[key] = rev
        self._put(k, key, msg, rev)

    def _skip(self, key: str, rev: int, exc: Exception, *, kind: str) -> None:
        self.skipped += 1
        self.skipped_by_kind[kind] += 1
        self._revs[key] = rev
        _skipped_counter.add(1, {"view": self._name, "kind": kind})
        log.warning("view %s: skipped undecodable value under %r (rev %d): %s", self._name, key, rev, exc)

    def apply_local(self, key: str, rev: int, msg: Message | None, traceparent: str = "") -> None:
        """Apply a write this process just committed (read-your-writes before the watch echo arrives)."""
        if rev <= self._revs.get(key, 0):
            return
        if traceparent:
            self._note_trace(key, rev, traceparent)
        self.last_revision = max(self.last_revision, rev)
        k = K.parse(key)
        self._note_kind_revision(k.kind, rev)
        if msg is None:
            self._remove(k, key)
            return
        self._revs[key] = rev
        if k.kind == K.ASSIGNMENT:
            decoded = pb.Assignment()
            decoded.CopyFrom(msg)  # type: ignore[arg-type]
            decoded.ClearField("observed")
            msg = decoded
        self._put(k, key, msg, rev)

    def _note_kind_revision(self, kind: str, rev: int) -> None:
        if rev > self._kind_revisions.get(kind, 0):
            self._kind_revisions[kind] = rev

    def kind_revision(self, kind: str) -> int:
        """Newest revision of any put or delete of ``kind`` seen (a delete counts while its marker is seen).

        Unlike :attr:`last_revision` it does not move on writes of other kinds (lease renewals), so
        two views at the same state agree on it: route snapshots derive their version from it.
        """
        return self._kind_revisions.get(kind, 0)

    def _put(self, k: K.Key, key: str, msg: Message, rev: int) -> None:
        self.applied += 1
        kind = k.kind
        if kind == K.OBSERVED:
            self._put_observed(k, msg)  # type: ignore[arg-type]
            return
        ident = k.id
        items = self._items[kind]
        old = items.get(ident)
        if kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            observed = self._observed.get((k.node_id, ident))
            if observed is not None:
                msg.observed.CopyFrom(observed)
        if old is not None:
            self._unindex(kind, ident, old.msg)
        items[ident] = Entry(msg, rev)
        self._key_of[(kind, ident)] = key
        self._index(kind, ident, msg)
        self._sorted_cache.pop(kind, None)
        self._notify(kind, ident)

    def _put_observed(self, k: K.Key, new: pb.AssignmentObserved) -> None:
        slot = (k.node_id, k.id)
        merged = merge_observed(self._observed.get(slot), new)
        self._observed[slot] = merged
        entry = self._items[K.ASSIGNMENT].get(k.id)
        if entry is not None:
            assignment = entry.msg
            assert isinstance(assignment, pb.Assignment)
            if assignment.node_id == k.node_id:
                assignment.observed.CopyFrom(merged)
                self._notify(K.ASSIGNMENT, k.id)
        self._notify(K.OBSERVED, k.id)

    def _remove(self, k: K.Key, key: str) -> None:
        self._revs.pop(key, None)
        self._traces.pop(key, None)
        if k.kind == K.OBSERVED:
            slot = (k.node_id, k.id)
            if self._observed.pop(slot, None) is not None:
                entry = self._items[K.ASSIGNMENT].get(k.id)
                if entry is not None and entry.msg.node_id == k.node_id:  # type: ignore[attr-defined]
                    entry.msg.ClearField("observed")
                    self._notify(K.ASSIGNMENT, k.id)
                self._notify(K.OBSERVED, k.id)
            return
        old = self._items[k.kind].pop(k.id, None)
        self._key_of.pop((k.kind, k.id), None)
        if old is None:
            return
        self._unindex(k.kind, k.id, old.msg)
        self._sorted_cache.pop(k.kind, None)
        self._notify(k.kind, k.id)

    def _notify(self, kind: str, ident: str) -> None:
        for feed in self._feeds:
            feed._offer(kind, ident)

    # ------------------------------------------------------------------ indexes

    def _index(self, kind: str, ident: str, msg: Message) -> None:
        field_name = _ENV_INDEXED.get(kind)
        if field_name:
            self._idx.by_env[getattr(msg, field_name)][kind][ident] = msg
        if kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            self._idx.assignments_by_node[msg.node_id][ident] = msg
            self._idx.assignments_by_release[msg.release_id].add(ident)
            if msg.desired == RUN:
                self._count_run(ident, msg)
        elif kind == K.RELEASE:
            self._recount_release(ident)

    def _unindex(self, kind: str, ident: str, msg: Message) -> None:
        field_name = _ENV_INDEXED.get(kind)
        if field_name:
            env_id = getattr(msg, field_name)
            per_env = self._idx.by_env.get(env_id)
            if per_env is not None:
                per_env[kind].pop(ident, None)
        if kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            by_node = self._idx.assignments_by_node.get(msg.node_id)
            if by_node is not None:
                by_node.pop(ident, None)
                if not by_node:
                    del self._idx.assignments_by_node[msg.node_id]
            by_release = self._idx.assignments_by_release.get(msg.release_id)
            if by_release is not None:
                by_release.discard(ident)
                if not by_release:
                    del self._idx.assignments_by_release[msg.release_id]
            self._uncount_run(ident)
        elif kind == K.RELEASE:
            self._recount_release(ident)

    def _count_run(self, ident: str, a: pb.Assignment) -> None:
        release = self.release(a.release_id)
        cpu, mem = reservation(release)
        reserved = self._idx.reserved[a.node_id]
        reserved[0] += cpu
        reserved[1] += mem
        self._idx.contribution[ident] = (a.node_id, cpu, mem)
        self._idx.env_node_run[a.environment_id][a.node_id] += 1
        self._idx.run_counted[ident] = (a.environment_id, a.node_id)

    def _uncount_run(self, ident: str) -> None:
        contribution = self._idx.contribution.pop(ident, None)
        if contribution is not None:
            node_id, cpu, mem = contribution
            reserved = self._idx.reserved[node_id]
            reserved[0] -= cpu
            reserved[1] -= mem
            if reserved == [0, 0]:
                del self._idx.reserved[node_id]
        counted = self._idx.run_counted.pop(ident, None)
        if counted is not None:
            env_id, node_id = counted
            per_node = self._idx.env_node_run[env_id]
            per_node[node_id] -= 1
            if per_node[node_id] <= 0:
                del per_node[node_id]
            if not per_node:
                del self._idx.env_node_run[env_id]

    def _recount_release(self, release_id: str) -> None:
        """A release arrived or changed after its assignments: their reservations follow its spec."""
        for aid in list(self._idx.assignments_by_release.get(release_id, ())):
            entry = self._items[K.ASSIGNMENT].get(aid)
            if entry is not None and aid in self._idx.contribution:
                self._uncount_run(aid)
                self._count_run(aid, entry.msg)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ change feeds

    def subscribe(self, kinds: Iterable[str] = ()) -> ChangeFeed:
        feed = ChangeFeed(self, kinds)
        self._feeds.add(feed)
        return feed

    # ------------------------------------------------------------------ generic reads

    def rev(self, key: str) -> int:
        """Revision of the key's last write (0 when absent): the expectation for a fenced write."""
        return self._revs.get(key, 0)

    def _note_trace(self, key: str, rev: int, traceparent: str) -> None:
        held = self._traces.get(key)
        if held is None or rev >= held[0]:
            self._traces[key] = (rev, traceparent)

    def trace_headers(self, key: str) -> dict[str, str]:
        """The trace context (``traceparent``) of the key's last write, as headers for ``telemetry.span``:
        a service reacting to a write continues the writer's trace (empty when the write carried none)."""
        held = self._traces.get(key)
        if held is None or held[0] != self._revs.get(key):
            return {}
        return {"traceparent": held[1]}

    def key_of(self, kind: str, ident: str) -> str | None:
        """The state key of a (kind, id) the view holds (what a ChangeFeed reports), else None."""
        return self._key_of.get((kind, ident))

    def get(self, kind: str, ident: str) -> Message | None:
        entry = self._items[kind].get(ident)
        return entry.msg if entry else None

    def entry(self, kind: str, ident: str) -> Entry | None:
        return self._items[kind].get(ident)

    def key(self, kind: str, ident: str) -> str | None:
        return self._key_of.get((kind, ident))

    def count(self, kind: str) -> int:
        return len(self._items[kind])

    def all(self, kind: str) -> list[Any]:
        """Every object of a kind, sorted by id (cached until the kind changes)."""
        cached = self._sorted_cache.get(kind)
        if cached is None:
            items = self._items[kind]
            cached = [items[i].msg for i in sorted(items)]
            self._sorted_cache[kind] = cached
        return cached

    def _env_list(self, env_id: str, kind: str) -> list[Any]:
        per_env = self._idx.by_env.get(env_id)
        if not per_env:
            return []
        objs = per_env.get(kind)
        if not objs:
            return []
        return [objs[i] for i in sorted(objs)]

    # ------------------------------------------------------------------ typed reads

    def node(self, node_id: str) -> pb.Node | None:
        return self.get(K.NODE, node_id)  # type: ignore[return-value]

    def nodes(self) -> list[pb.Node]:
        return self.all(K.NODE)

    def project(self, project_id: str) -> pb.Project | None:
        return self.get(K.PROJECT, project_id)  # type: ignore[return-value]

    def app(self, app_id: str) -> pb.App | None:
        return self.get(K.APP, app_id)  # type: ignore[return-value]

    def env(self, env_id: str) -> pb.Environment | None:
        return self.get(K.ENV, env_id)  # type: ignore[return-value]

    def envs(self) -> list[pb.Environment]:
        return self.all(K.ENV)

    def release(self, release_id: str) -> pb.Release | None:
        return self.get(K.RELEASE, release_id)  # type: ignore[return-value]

    def releases(self, env_id: str | None = None) -> list[pb.Release]:
        return self.all(K.RELEASE) if env_id is None else self._env_list(env_id, K.RELEASE)

    def deployment(self, deployment_id: str) -> pb.Deployment | None:
        return self.get(K.DEPLOYMENT, deployment_id)  # type: ignore[return-value]

    def deployments(self, env_id: str | None = None) -> list[pb.Deployment]:
        return self.all(K.DEPLOYMENT) if env_id is None else self._env_list(env_id, K.DEPLOYMENT)

    def build(self, build_id: str) -> pb.Build | None:
        return self.get(K.BUILD, build_id)  # type: ignore[return-value]

    def builds(self, env_id: str | None = None) -> list[pb.Build]:
        return self.all(K.BUILD) if env_id is None else self._env_list(env_id, K.BUILD)

    def assignment(self, assignment_id: str) -> pb.Assignment | None:
        return self.get(K.ASSIGNMENT, assignment_id)  # type: ignore[return-value]

    def assignments(self, env_id: str | None = None) -> list[pb.Assignment]:
        return self.all(K.ASSIGNMENT) if env_id is None else self._env_list(env_id, K.ASSIGNMENT)

    def assignments_by_node(self, node_id: str) -> list[pb.Assignment]:
        objs = self._idx.assignments_by_node.get(node_id)
        return [objs[i] for i in sorted(objs)] if objs else []

    def assignment_ids_by_release(self, release_id: str) -> frozenset[str]:
        return frozenset(self._idx.assignments_by_release.get(release_id, ()))

    def observed(self, node_id: str, assignment_id: str) -> pb.AssignmentObserved | None:
        return self._observed.get((node_id, assignment_id))

    def observed_keys(self) -> Iterator[tuple[str, str]]:
        """(node_id, assignment_id) of every observed report, joined or not."""
        return iter(list(self._observed))

    def volume(self, volume_id: str) -> pb.Volume | None:
        return self.get(K.VOLUME, volume_id)  # type: ignore[return-value]

    def volumes(self, env_id: str | None = None) -> list[pb.Volume]:
        return self.all(K.VOLUME) if env_id is None else self._env_list(env_id, K.VOLUME)

    def snapshot(self, snapshot_id: str) -> pb.VolumeSnapshot | None:
        return self.get(K.SNAPSHOT, snapshot_id)  # type: ignore[return-value]

    def snapshots(self) -> list[pb.VolumeSnapshot]:
        return self.all(K.SNAPSHOT)

    def domains(self, env_id: str | None = None) -> list[pb.Domain]:
        return self.all(K.DOMAIN) if env_id is None else self._env_list(env_id, K.DOMAIN)

    def jobs(self, env_id: str | None = None) -> list[pb.Job]:
        """Job runs (cron slots and one-off commands), sorted by id."""
        return self.all(K.JOB) if env_id is None else self._env_list(env_id, K.JOB)

    def secrets(self, env_id: str) -> list[pb.SealedSecret]:
        """Every sealed secret version of an environment (ciphertexts only)."""
        return self._env_list(env_id, K.SECRET)

    def images(self) -> list[pb.Image]:
        return self.all(K.IMAGE)

    def vip(self, env_id: str) -> pb.ServiceVIP | None:
        return self.get(K.VIP, env_id)  # type: ignore[return-value]

    def vips(self) -> list[pb.ServiceVIP]:
        return self.all(K.VIP)

    def lease(self, loop: str) -> pb.Lease | None:
        return self.get(K.LEASE, loop)  # type: ignore[return-value]

    # ------------------------------------------------------------------ incremental aggregates

    def reserved(self, node_id: str) -> tuple[int, int]:
        """(cpu_millis, memory_mb) reserved on a node by RUN assignments of every env (jobs included)."""
        r = self._idx.reserved.get(node_id)
        return (r[0], r[1]) if r else (0, 0)

    def env_run_by_node(self, env_id: str) -> dict[str, int]:
        """RUN assignments of an env per node (read-only view; do not mutate)."""
        return self._idx.env_node_run.get(env_id, {})

    def env_run_count(self, env_id: str) -> int:
        return sum(self._idx.env_node_run.get(env_id, {}).values())


_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def guard_ordered_consumer(sub: Any, new_name: Any) -> None:
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


def _is_delete(msg: Msg) -> bool:
    headers = msg.headers
    if not headers:
        return False
    op = headers.get("KV-Operation")
    if op in _DELETE_OPS:
        return True
    return "Nats-Marker-Reason" in headers


def monotonic_ms() -> float:
    return time.monotonic() * 1000.0
