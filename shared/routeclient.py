"""Route snapshots on the wire, and the client a proxy uses to hold the current one (DESIGN §3, §6).

Wire format of a snapshot message (on ``zattera.routes.snapshot`` and in ``zattera.routes.get``
replies). The body is a serialized ``RouteSnapshot``, possibly compressed, possibly cut in chunks:

=========================== ==========================================================================
header                      meaning
=========================== ==========================================================================
``Zattera-Routes-Version``  the snapshot's version (decimal); on every message, so a receiver can drop
                            stale and duplicate snapshots without decoding them
``Zattera-Routes-Digest``   SHA-256 (hex) of the snapshot encoded *without* its version: equal content
                            ⇔ equal digest. Route builders compare it; chunks are grouped by it
``Content-Encoding``        ``zstd`` or ``gzip`` when the body (before chunking) is compressed; absent =
                            plain. Builders compress above :data:`COMPRESS_ABOVE` bytes (zstd level 3)
``Zattera-Routes-Chunk``    ``<index>/<count>`` (0-based) when the encoded body exceeds one message
                            (the server's max_payload less :data:`HEADER_ROOM`); absent = one message
``Zattera-Routes-Unchanged`` ``true`` on an empty ``zattera.routes.get`` reply: ``have_version`` is current
=========================== ==========================================================================

Chunks of one snapshot are published back to back, in index order, by one publisher; a receiver
concatenates the ``count`` bodies of one (version, digest) in index order, then decompresses and parses.
The ``ZATTERA_ROUTES`` stream keeps only the last message of the subject, so for a chunked snapshot it
holds only the last chunk: enough for a builder to learn the newest version and digest, never read as
a snapshot. Clients get the whole current snapshot from ``zattera.routes.get`` (replies use the same
messages, sent to the request's reply subject).

:class:`RouteClient` (fixes over the reference RouteClient, spec A2.4): snapshots are ordered by version
(stale and duplicate ones are dropped, so keep-alives do not rewrite the cache), the cache is written
atomically *and durably* (temp file, fsync, rename, fsync of the directory) off the event loop, and the
retry backoff resets after a successful fetch. Like the reference it loads the cache before any network
activity and serves the last snapshot, without expiry, while the control plane is unreachable.

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
import gzip
import hashlib
import logging
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import zstandard
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.backoff import Backoff
from shared.clock import Clock, RealClock
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.files import write_atomic
from shared.provisioning import ClusterIdentity
from shared.subjects import ROUTES_GET_SUBJECT, ROUTES_SNAPSHOT_SUBJECT
from shared.tasks import cancel_and_wait, raise_if_cancelling
from shared.telemetry import counter

log = logging.getLogger(__name__)

VERSION_HEADER = "Zattera-Routes-Version"
DIGEST_HEADER = "Zattera-Routes-Digest"
CHUNK_HEADER = "Zattera-Routes-Chunk"
UNCHANGED_HEADER = "Zattera-Routes-Unchanged"
ENCODING_HEADER = "Content-Encoding"
ZSTD = "zstd"
GZIP = "gzip"

COMPRESS_ABOVE = 64 * 1024
"""Snapshots larger than this (bytes, serialized) are zstd-compressed."""
HEADER_ROOM = 4096
"""Bytes of a message kept for headers when cutting chunks."""
MAX_SNAPSHOT_BYTES = 1 << 30
"""Decompression bound: a corrupt or hostile body cannot make a receiver allocate more."""
ZSTD_LEVEL = 3

_NO_RESPONDERS = "503"
VERIFY_RETRY = 0.5
"""Seconds before asking a route replica again when it answered with an older snapshot than pushed."""
_rejected = counter("zattera.routes.rejected", "route snapshot messages that could not be decoded")


class SnapshotDecodeError(ZatteraError, ValueError):
    """A snapshot message that cannot be decoded (bad header, chunk, compression or protobuf)."""


# ---------------------------------------------------------------------------------------------- codec


def content_digest(content: bytes) -> str:
    """Digest of a snapshot encoded without its version (see the module docstring)."""
    return hashlib.sha256(content).hexdigest()


@dataclass(frozen=True, slots=True)
class WireMessage:
    headers: dict[str, str]
    body: bytes


def encode_messages(
    snapshot: bytes, *, version: int, digest: str, max_message_bytes: int, compress_above: int = COMPRESS_ABOVE
) -> list[WireMessage]:
    """The messages carrying one serialized snapshot: compressed above ``compress_above`` bytes, then
    cut in chunks of at most ``max_message_bytes`` (body only). Deterministic: the same snapshot gives
    the same messages on every route replica."""
    headers = {VERSION_HEADER: str(version), DIGEST_HEADER: digest}
    body = snapshot
    if len(snapshot) > compress_above:
        body = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(snapshot)
        headers[ENCODING_HEADER] = ZSTD
    if len(body) <= max_message_bytes:
        return [WireMessage(headers, body)]
    count = -(-len(body) // max_message_bytes)
    return [
        WireMessage(
            {**headers, CHUNK_HEADER: f"{index}/{count}"},
            body[index * max_message_bytes : (index + 1) * max_message_bytes],
        )
        for index in range(count)
    ]


def message_version(headers: Mapping[str, str] | None) -> int | None:
    """The version a message announces, or None when it has no (valid) version header."""
    raw = (headers or {}).get(VERSION_HEADER)
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


def decode_body(headers: Mapping[str, str] | None, body: bytes) -> cpb.RouteSnapshot:
    """A whole (reassembled) body → snapshot."""
    encoding = (headers or {}).get(ENCODING_HEADER, "")
    try:
        if encoding == ZSTD:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_SNAPSHOT_BYTES)
        elif encoding == GZIP:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            body = inflater.decompress(body, MAX_SNAPSHOT_BYTES)
            if inflater.unconsumed_tail:
                raise SnapshotDecodeError("gzip body exceeds the snapshot size bound")
        elif encoding:
            raise SnapshotDecodeError(f"unknown Content-Encoding {encoding!r}")
        snapshot = cpb.RouteSnapshot()
        snapshot.ParseFromString(body)
    except (zstandard.ZstdError, zlib.error, gzip.BadGzipFile, DecodeError) as exc:
        raise SnapshotDecodeError(str(exc)) from exc
    return snapshot


class SnapshotAssembler:
    """Turns snapshot messages, single or chunked, back into snapshots.

    Keeps the chunks of one snapshot at a time (the newest version started); an incomplete older set
    is dropped when a newer one starts, so memory stays bounded by one snapshot.
    """

    def __init__(self) -> None:
        self._key: tuple[int, str, int] | None = None
        self._parts: dict[int, bytes] = {}
        self._headers: Mapping[str, str] = {}

    def add(self, headers: Mapping[str, str] | None, body: bytes) -> cpb.RouteSnapshot | None:
        """Feed one message; returns the snapshot once complete. Raises :class:`SnapshotDecodeError`."""
        headers = headers or {}
        chunk = headers.get(CHUNK_HEADER)
        if chunk is None:
            return decode_body(headers, body)
        version = message_version(headers)
        index, count = _parse_chunk(chunk)
        if version is None:
            raise SnapshotDecodeError("chunk without a version")
        key = (version, headers.get(DIGEST_HEADER, ""), count)
        if key != self._key:
            if self._key is not None and version < self._key[0]:
                return None
            self._key, self._parts, self._headers = key, {}, headers
        self._parts[index] = body
        if len(self._parts) < count:
            return None
        whole = b"".join(self._parts[i] for i in range(count))
        self._key, self._parts = None, {}
        return decode_body(self._headers, whole)


def _parse_chunk(value: str) -> tuple[int, int]:
    index_text, _, count_text = value.partition("/")
    if not index_text.isdigit() or not count_text.isdigit():
        raise SnapshotDecodeError(f"bad {CHUNK_HEADER} header {value!r}")
    index, count = int(index_text), int(count_text)
    if not 0 <= index < count:
        raise SnapshotDecodeError(f"bad {CHUNK_HEADER} header {value!r}")
    return index, count


# ---------------------------------------------------------------------------------------------- cache


def identity_message(identity: ClusterIdentity) -> cpb.ClusterIdentity:
    """The wire form of a cluster identity."""
    return cpb.ClusterIdentity(id=identity.id, epoch=identity.epoch)


def same_cluster(a: cpb.ClusterIdentity, b: cpb.ClusterIdentity) -> bool:
    """Whether two snapshots' versions are comparable: built from the same cluster's state stream."""
    return a.id == b.id and a.epoch == b.epoch


def cluster_text(identity: cpb.ClusterIdentity) -> str:
    """How messages name a cluster: ``<id> (state since <epoch>)``; an unnamed one says so."""
    if not identity.id and not identity.epoch:
        return "an unnamed cluster"
    return f"cluster {identity.id or '(no id)'} (state since {identity.epoch or '?'})"


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


# ---------------------------------------------------------------------------------------------- client


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

    Construction loads the cache file (no network). :meth:`start` subscribes to
    ``zattera.routes.snapshot`` and fetches the current snapshot with ``zattera.routes.get``, again
    after every reconnect (retrying with backoff until a route replica answers).
    """

    def __init__(
        self,
        cache_path: Path | str,
        *,
        node_id: str = "",
        request_timeout: float = 2.0,
        retry_initial: float = 0.25,
        retry_max: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        self.path = Path(cache_path)
        self.node_id = node_id
        self.request_timeout = request_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.clock: Clock = clock or RealClock()
        self._current = load_cached(self.path)
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
