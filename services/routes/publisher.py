"""Distribution of route snapshots (docs/wire-contract.md): every routes replica runs one publisher.

* **Build**: a :class:`RouteBuilder` over the replica's view, fed by the view's change feed. Changes are
  coalesced by a trailing debounce (:data:`QUIET` of silence, at most :data:`MAX_DELAY` after the first
  change under constant churn), then only affected envs rebuild.
* **Version** (the same on every replica): the newest state revision, put or delete, among the kinds
  the snapshot reads (:meth:`StateView.kind_revision`), taken when the *content* changes. Lease renewals
  and other unrelated writes do not move it, and two replicas at the same state compute the same number,
  hence the same bytes. A replica also learns the newest (version, digest) anyone published — from the
  ``ZATTERA_ROUTES`` stream at start, then from the subject — and publishes only when its content differs
  from it and its revision is newer; equal content adopts the known version. So a restarted replica never
  goes back in version, and a replica whose view lags never overwrites a newer snapshot. One fallback:
  when a deletion's marker has expired from the bucket (all replicas down for longer than the tombstone
  TTL), the revision can read lower than the published version; the view's last revision is used then.
* **Publish** only when content changed, on ``zattera.routes.snapshot`` (stored in the stream, last
  message only), plus a keep-alive of the same bytes every :data:`KEEPALIVE` seconds of the injected clock.
  Encoding, compression and chunking: :mod:`shared.routeclient`.
* **Serve** ``zattera.routes.get`` in queue group :data:`QUEUE_GROUP`, once the replica has a snapshot
  (never an empty version-0 snapshot before its first build); "unchanged" only when
  the requester's version and cluster are this replica's.
* **Cluster**: every snapshot names the cluster it was built from (``RouteSnapshot.cluster``, read from the
  state stream at start): a proxy compares versions only between snapshots of one cluster. A snapshot
  found in the stream that predates the state stream (a stream created anew) is not taken as published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.errors import Error as JetStreamError
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.routes.builder import RELEVANT_KINDS, RouteBuilder
from services.routes.env_routes import encode_snapshot
from shared.clock import Clock, ticker
from shared.connection import Connection
from shared.provisioning import ClusterIdentity, cluster_identity
from shared.routewire import (
    COMPRESS_ABOVE,
    DIGEST_HEADER,
    HEADER_ROOM,
    UNCHANGED_HEADER,
    WireMessage,
    content_digest,
    encode_messages,
    identity_message,
    message_version,
    same_cluster,
)
from shared.state.changes import Change, ChangeFeed
from shared.state.feed import StateView
from shared.subjects import ROUTES_GET_SUBJECT, ROUTES_SNAPSHOT_SUBJECT, ROUTES_STREAM, is_direct_request
from shared.tasks import cancel_and_wait, raise_if_cancelling
from shared.telemetry import counter, span

log = logging.getLogger(__name__)

QUIET = 0.03
MAX_DELAY = 0.2
KEEPALIVE = 15.0
QUEUE_GROUP = "zattera-routes"

_published = counter("zattera.routes.published", "route snapshots published with new content")
_bad_requests = counter("zattera.routes.bad_requests", "undecodable zattera.routes.get requests")


@dataclass
class Snapshot:
    """A snapshot this replica serves: version + version-less content, its wire messages made once."""

    version: int
    content: bytes
    digest: str
    _messages: list[WireMessage] | None = field(default=None, repr=False)

    def encoded(self) -> bytes:
        return encode_snapshot(self.version, self.content)

    def messages(self, max_message_bytes: int, compress_above: int) -> list[WireMessage]:
        if self._messages is None:
            self._messages = encode_messages(
                self.encoded(),
                version=self.version,
                digest=self.digest,
                max_message_bytes=max_message_bytes,
                compress_above=compress_above,
            )
        return self._messages


@dataclass(eq=False)
class RoutesPublisher:
    """Builds, publishes and serves route snapshots for one replica (see the module docstring)."""

    conn: Connection
    view: StateView
    _: KW_ONLY
    domain: str
    clock: Clock
    quiet: float = QUIET
    max_delay: float = MAX_DELAY
    keepalive: float = KEEPALIVE
    compress_above: int = COMPRESS_ABOVE
    max_message_bytes: int | None = None
    """None: the server's payload limit, less room for the headers (:attr:`message_limit`)."""

    def __post_init__(self) -> None:
        self.builder = RouteBuilder(self.view, domain=self.domain)
        self.current: Snapshot | None = None
        self.known_version = -1  # newest version published by anyone (-1: none seen)
        self.known_digest = ""
        self._unpublished = False
        self.ready = asyncio.Event()
        self.publishes = 0  # messages sent on the subject (new content and keep-alives)

    @property
    def message_limit(self) -> int:
        return self.max_message_bytes or self.conn.nc.max_payload - HEADER_ROOM

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        nc = self.conn.nc
        await self.view.wait_fresh()
        identity = await cluster_identity(self.conn.js)
        self.builder.cluster = identity_message(identity)
        await self._learn_published(identity)
        peers = await nc.subscribe(ROUTES_SNAPSHOT_SUBJECT, cb=self._on_published)
        feed = self.view.subscribe(RELEVANT_KINDS)
        responder: Subscription | None = None
        keepalive: asyncio.Task[None] | None = None
        try:
            feed.drain()
            with span("routes.build", full=True):
                self.builder.rebuild_all()
            await self._settle()
            raise_if_cancelling()
            responder = await nc.subscribe(ROUTES_GET_SUBJECT, queue=QUEUE_GROUP, cb=self._on_get)
            await nc.flush()  # the responder is registered on the server before anyone is told we are ready
            keepalive = asyncio.create_task(self._keep_alive())
            self.ready.set()
            while True:
                raise_if_cancelling()
                changes = await self._debounced(feed)
                await self.view.wait_fresh()
                with span("routes.build", changes=len(changes)) as build_span:
                    affected = self.builder.apply_changes(changes)
                    build_span.set_attribute("envs", len(affected))
                await self._settle()
        finally:
            feed.close()
            await cancel_and_wait(keepalive)
            for sub in (responder, peers):
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def _debounced(self, feed: ChangeFeed) -> set[Change]:
        """The next changes, held until :attr:`quiet` passes without one, at most :attr:`max_delay`."""
        changes = await feed.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_delay
        while (budget := min(self.quiet, deadline - loop.time())) > 0:
            more = await feed.wait(budget)
            if not more:
                break
            changes |= more
        return changes

    # ------------------------------------------------------------------ deciding

    async def _settle(self) -> None:
        """Decide the version of the built content and publish it if it is news (module docstring)."""
        content = self.builder.content()
        current = self.current
        if current is not None and content == current.content:
            if self._unpublished:
                await self._publish(current)
            return
        digest = content_digest(content)
        if digest == self.known_digest:
            self.current = Snapshot(self.known_version, content, digest)
            return
        revision = self.builder.revision
        if revision > self.known_version:
            version = revision
        elif self.view.last_revision > self.known_version:
            log.info("routes: revision %d not above published %d; using the view's", revision, self.known_version)
            version = self.view.last_revision
        else:
            log.debug("routes: view behind published version %d; waiting for it", self.known_version)
            return
        self.current = Snapshot(version, content, digest)
        self.known_version, self.known_digest = version, digest
        _published.add(1)
        await self._publish(self.current)

    async def _publish(self, snapshot: Snapshot) -> None:
        try:
            for message in snapshot.messages(self.message_limit, self.compress_above):
                await self.conn.js.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
                self.publishes += 1
            self._unpublished = False
        except (NatsError, JetStreamError, TimeoutError) as exc:
            self._unpublished = True
            log.warning(
                "routes: snapshot %d not published (retried on the next change or tick): %s", snapshot.version, exc
            )

    async def _keep_alive(self) -> None:
        async for _ in ticker(self.clock, self.keepalive):
            raise_if_cancelling()
            current = self.current
            if current is not None and current.version >= self.known_version:
                await self._publish(current)

    # ------------------------------------------------------------------ what others published

    async def _learn_published(self, identity: ClusterIdentity) -> None:
        try:
            last = await self.conn.js.get_last_msg(ROUTES_STREAM, ROUTES_SNAPSHOT_SUBJECT)
        except JetStreamError:
            return  # nothing published yet
        if last.time is not None and identity.epoch and last.time < datetime.fromisoformat(identity.epoch):
            # Published before this state stream existed: another life of the cluster, whose versions say
            # nothing about this one's (module docstring).
            log.info("routes: the last published snapshot predates the state stream (%s); ignored", identity.epoch)
            return
        self._note_published(last.headers)

    async def _on_published(self, msg: Msg) -> None:
        self._note_published(msg.headers)

    def _note_published(self, headers: dict[str, str] | None) -> None:
        version = message_version(headers)
        if version is None or version <= self.known_version:
            return
        self.known_version = version
        self.known_digest = (headers or {}).get(DIGEST_HEADER, "")
        current = self.current
        if current is not None and current.digest == self.known_digest:
            self.current = Snapshot(version, current.content, current.digest)

    # ------------------------------------------------------------------ zattera.routes.get

    async def _on_get(self, msg: Msg) -> None:
        current = self.current
        if current is None or not is_direct_request(msg):
            return  # no reply, or one steered at a subject no requester owns
        request = cpb.WatchRoutesRequest()
        try:
            request.ParseFromString(msg.data)
        except DecodeError:
            _bad_requests.add(1)
            log.warning("routes.get: undecodable request; answering with the snapshot")
        try:
            same = not request.HasField("have_cluster") or same_cluster(request.have_cluster, self.builder.cluster)
            if request.have_version == current.version and same:
                await self.conn.nc.publish(msg.reply, b"", headers={UNCHANGED_HEADER: "true"})
                return
            for message in current.messages(self.message_limit, self.compress_above):
                await self.conn.nc.publish(msg.reply, message.body, headers=message.headers)
        except NatsError as exc:
            log.warning("routes.get: reply not sent: %s", exc)
