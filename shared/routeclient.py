"""The client a proxy uses to hold the current route snapshot, and its cache file (wire format:
``shared/routewire.py``).

:class:`RouteClient`: snapshots are ordered by version (stale and duplicate ones are dropped, so
keep-alives do not rewrite the cache), the cache is written whole and durably (:mod:`shared.files`) off
the event loop, and the retry backoff resets after a successful fetch. It loads the cache before any
network activity and serves the last snapshot, without expiry, while the control plane is unreachable.

Versions are state-bucket revisions, so they order the snapshots of one cluster only: a snapshot names
the cluster it was built from (``RouteSnapshot.cluster``: the id its init recorded and the state stream's
creation, :class:`shared.provisioning.ClusterIdentity`), and versions are compared only between snapshots of the
same cluster. A snapshot of another cluster than the current one — a cached snapshot kept from the open
cluster a data dir held before ``--secure``, from a state bucket since created anew — is never preferred
by its version: the client takes another cluster's snapshot only from a route service's own answer to
``zattera.routes.get`` (which says "unchanged" only when version *and* cluster match), never from a push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.backoff import Backoff
from shared.clock import Clock, RealClock
from shared.connection import Connection
from shared.files import write_atomic
from shared.routewire import UNCHANGED_HEADER, SnapshotAssembler, SnapshotDecodeError, message_version, same_cluster
from shared.subjects import ROUTES_GET_SUBJECT, ROUTES_SNAPSHOT_SUBJECT
from shared.tasks import cancel_and_wait, raise_if_cancelling
from shared.telemetry import counter

log = logging.getLogger(__name__)


_NO_RESPONDERS = "503"


VERIFY_RETRY = 0.5
"""Seconds before asking a route replica again when it answered with an older snapshot than pushed."""


_rejected = counter("zattera.routes.rejected", "route snapshot messages that could not be decoded")


def load_cached(path: Path) -> cpb.RouteSnapshot:
    """The cached snapshot; an empty version-0 one when the file is missing or unreadable."""
    snapshot = cpb.RouteSnapshot()
    try:
        snapshot.ParseFromString(path.read_bytes())
    except FileNotFoundError:
        return cpb.RouteSnapshot()
    except (OSError, DecodeError) as exc:
        log.warning("route cache %s unreadable, starting empty: %s", path, exc)
        return cpb.RouteSnapshot()
    return snapshot


class RouteUpdates:
    """Latest-wins stream of accepted snapshots (capacity 1: a slow reader skips to the newest)."""

    def __init__(self, owner: RouteClient, initial: cpb.RouteSnapshot) -> None:
        self._owner = owner
        self._latest = initial
        self._ready = asyncio.Event()
        self._ready.set()

    def _offer(self, snapshot: cpb.RouteSnapshot) -> None:
        self._latest = snapshot
        self._ready.set()

    async def get(self) -> cpb.RouteSnapshot:
        await self._ready.wait()
        self._ready.clear()
        return self._latest

    def __aiter__(self) -> AsyncIterator[cpb.RouteSnapshot]:
        return self

    async def __anext__(self) -> cpb.RouteSnapshot:
        return await self.get()

    def close(self) -> None:
        self._owner._watchers.discard(self)


class RouteClient:
    """Holds the current route snapshot of a proxy.

    Construction loads the cache file (no network); without one (``cache_path`` None: a one-off reader such
    as the CLI) the snapshot is held in memory only. :meth:`start` subscribes to
    ``zattera.routes.snapshot`` and fetches the current snapshot with ``zattera.routes.get``, again
    after every reconnect (retrying with backoff until a route replica answers).
    """

    def __init__(
        self,
        cache_path: Path | str | None,
        *,
        node_id: str = "",
        request_timeout: float = 2.0,
        retry_initial: float = 0.25,
        retry_max: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        self.path = Path(cache_path) if cache_path is not None else None
        self.node_id = node_id
        self.request_timeout = request_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.clock: Clock = clock or RealClock()
        self._current = load_cached(self.path) if self.path is not None else cpb.RouteSnapshot()
        self._watchers: set[RouteUpdates] = set()
        self._assembler = SnapshotAssembler()
        self._conn: Connection | None = None
        self._subscription: Subscription | None = None
        self._sync_wanted = asyncio.Event()
        self._sync_task: asyncio.Task[None] | None = None
        self._persist_wanted = False
        self._persister: asyncio.Task[None] | None = None
        self._stopped = False
        self.applied = 0
        self.dropped = 0
        self._verify_wanted = False
        self._last_answer: cpb.RouteSnapshot | None = None

    @property
    def current(self) -> cpb.RouteSnapshot:
        """The snapshot to route with (shared: never mutate it)."""
        return self._current

    @property
    def version(self) -> int:
        return self._current.version

    def updates(self) -> RouteUpdates:
        """A new latest-wins stream, primed with the current snapshot."""
        watcher = RouteUpdates(self, self._current)
        self._watchers.add(watcher)
        return watcher

    def apply(self, snapshot: cpb.RouteSnapshot, *, authoritative: bool = False) -> bool:
        """Take ``snapshot`` if it is newer than the current one (True); stale and duplicate ones are
        dropped (False). An accepted snapshot is served at once and persisted in the background.

        ``authoritative``: a route service's own answer (a confirmed one, see :meth:`_verify`, or one for
        another cluster than the current snapshot's), taken even when older, so a forged snapshot with a
        huge version cannot pin the client. A snapshot of another cluster is taken only so: versions of two
        clusters are not comparable (module docstring)."""
        if self._current.version and not same_cluster(snapshot.cluster, self._current.cluster):
            if not authoritative:
                self.dropped += 1
                return False
        elif snapshot.version == self._current.version or (
            snapshot.version < self._current.version and not authoritative
        ):
            self.dropped += 1
            return False
        self._current = snapshot
        self.applied += 1
        for watcher in list(self._watchers):
            watcher._offer(snapshot)
        self._persist_latest()
        return True

    # ------------------------------------------------------------------ persistence

    def _persist_latest(self) -> None:
        if self.path is None:
            return
        self._persist_wanted = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop (tools): write now
            self._persist_wanted = False
            write_atomic(self.path, self._current.SerializeToString(deterministic=True))
            return
        if self._persister is None or self._persister.done():
            self._persister = loop.create_task(self._write_latest())

    async def _write_latest(self) -> None:
        assert self.path is not None  # only started with a cache file
        while self._persist_wanted:
            self._persist_wanted = False
            data = self._current.SerializeToString(deterministic=True)
            try:
                await asyncio.to_thread(write_atomic, self.path, data)
            except OSError as exc:
                log.warning("route cache %s not written (routes still served from memory): %s", self.path, exc)

    async def flush(self) -> None:
        """Wait until the current snapshot is on disk."""
        while self._persister is not None and not self._persister.done():
            await asyncio.shield(self._persister)

    # ------------------------------------------------------------------ network

    async def start(self, conn: Connection) -> None:
        self._conn = conn
        self._stopped = False
        self._subscription = await conn.nc.subscribe(
            ROUTES_SNAPSHOT_SUBJECT, cb=self._on_message, pending_bytes_limit=256 * 1024 * 1024
        )
        conn.on_reconnect(self._on_reconnect)
        self._sync_wanted.set()
        self._sync_task = asyncio.create_task(self._sync_loop())

    async def stop(self) -> None:
        self._stopped = True
        await cancel_and_wait(self._sync_task)
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None
        await self.flush()

    async def _on_reconnect(self) -> None:
        if not self._stopped:
            self._sync_wanted.set()

    async def _on_message(self, msg: Msg) -> None:
        headers = msg.headers
        version = message_version(headers)
        if version is not None and version <= self._current.version:
            self.dropped += 1  # a keep-alive or a stale replica: no need to decode it
            return
        try:
            snapshot = self._assembler.add(headers, msg.data)
        except SnapshotDecodeError as exc:
            _rejected.add(1)
            log.warning("route snapshot message rejected: %s", exc)
            return
        if snapshot is None:
            return
        if self._current.version and not same_cluster(snapshot.cluster, self._current.cluster):
            # Not comparable with ours: whether this cluster's routes replace ours is the route service's word.
            self.dropped += 1
            self._sync_wanted.set()
            return
        if self.apply(snapshot):
            self._verify_wanted = True
            self._sync_wanted.set()

    async def _sync_loop(self) -> None:
        backoff = Backoff(self.retry_initial, self.retry_max)
        while True:
            raise_if_cancelling()  # nats-py can swallow a cancellation inside fetch's publish
            await self._sync_wanted.wait()
            self._sync_wanted.clear()
            if await self.fetch():
                backoff.reset()
                if self._verify_wanted:
                    self._verify_wanted = False
                    await self._verify()
                continue
            self._sync_wanted.set()
            await self.clock.sleep(next(backoff))

    async def _verify(self) -> None:
        """Check a pushed snapshot against a route service's own answer.

        Anyone allowed to publish on the snapshot subject could push a snapshot with a huge version, which
        would make every later real snapshot look stale. After each pushed snapshot the client asks a route
        replica; when the replica holds an older version, it asks once more after a short pause (a replica
        may simply lag by a debounce), and if the answer is still older it takes the replica's snapshot."""
        answer = await self._get()
        if answer is None or answer.version >= self._current.version or answer is self._current:
            return
        await asyncio.sleep(VERIFY_RETRY)
        answer = await self._get()
        if answer is None or answer.version >= self._current.version or answer is self._current:
            return
        log.warning(
            "route snapshot %d is unknown to the route service (which has %d): replacing it",
            self._current.version,
            answer.version,
        )
        self.apply(answer, authoritative=True)

    async def _get(self) -> cpb.RouteSnapshot | None:
        """A replica's snapshot when it differs from ours (None: unchanged or no answer)."""
        self._last_answer = None
        if not await self.fetch():
            return None
        return self._last_answer

    async def fetch(self) -> bool:
        """One ``zattera.routes.get`` round trip; True when a replica answered (unchanged or a snapshot)."""
        assert self._conn is not None, "start() first"
        nc = self._conn.nc
        inbox = nc.new_inbox()
        try:
            replies = await nc.subscribe(inbox)
        except NatsError as exc:
            log.debug("routes.get not sent: %s", exc)
            return False
        try:
            request = cpb.WatchRoutesRequest(node_id=self.node_id, have_version=self.version)
            request.have_cluster.CopyFrom(self._current.cluster)
            request.have_cluster.SetInParent()  # sent even when empty: "unchanged" must match the cluster too
            await nc.publish(ROUTES_GET_SUBJECT, request.SerializeToString(), reply=inbox)
            assembler = SnapshotAssembler()
            while True:
                msg = await replies.next_msg(timeout=self.request_timeout)
                headers = msg.headers or {}
                if headers.get("Status") == _NO_RESPONDERS:
                    return False
                if headers.get(UNCHANGED_HEADER) == "true":
                    self._last_answer = None
                    return True
                snapshot = assembler.add(headers, msg.data)
                if snapshot is not None:
                    self._last_answer = snapshot
                    # A route service's answer: the cluster this connection reaches, whatever our version.
                    self.apply(snapshot, authoritative=not same_cluster(snapshot.cluster, self._current.cluster))
                    return True
        except SnapshotDecodeError as exc:
            _rejected.add(1)
            log.warning("routes.get reply rejected: %s", exc)
            return False
        except (TimeoutError, NatsError) as exc:
            log.debug("routes.get unanswered: %s", exc)
            return False
        finally:
            with contextlib.suppress(Exception):
                await replies.unsubscribe()
