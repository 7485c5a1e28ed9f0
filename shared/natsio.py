"""NATS connection and provisioning of every bucket, stream and object store (docs/wire-contract.md): created when
missing from the configuration recorded in the cluster, never updated (docs/cluster.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    ObjectStoreConfig,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shared.backoff import exponential
from shared.defaults import LIVE_TTL, TOMBSTONE_TTL
from shared.errors import ZatteraError
from shared.ids import new_id
from shared.migrations.registry import SCHEMA
from shared.tasks import cancel_and_wait
from shared.version import VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")

_CRLF = b"\r\n"
_WHITESPACE = re.compile(r"\s")


def _parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's header parser with the same rules, minus its per-character Python loop.

    Every state-bucket message carries a few headers (expected revision, traceparent), and the
    original parser's ``any(c.isspace() for c in key)`` was a third of a view's apply time.
    """
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _WHITESPACE.search(key):
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


ORIGINAL_HEADER_PARSER = NATS.__dict__.get("_parse_header_lines")
if isinstance(ORIGINAL_HEADER_PARSER, staticmethod):
    NATS._parse_header_lines = staticmethod(_parse_header_lines)  # type: ignore[method-assign]

STATE_BUCKET = "zattera-state"
LIVE_BUCKET = "zattera-live"
STATE_STREAM = f"KV_{STATE_BUCKET}"
LIVE_STREAM = f"KV_{LIVE_BUCKET}"
STATE_PREFIX = f"$KV.{STATE_BUCKET}."
LIVE_PREFIX = f"$KV.{LIVE_BUCKET}."

EVENTS_STREAM = "ZATTERA_EVENTS"
EVENTS_SUBJECT_PREFIX = "zattera.events."
ROUTES_STREAM = "ZATTERA_ROUTES"
ROUTES_SNAPSHOT_SUBJECT = "zattera.routes.snapshot"
ROUTES_GET_SUBJECT = "zattera.routes.get"
ACTIVATE_SUBJECT = "zattera.activate"
BUILD_LOGS_STREAM = "ZATTERA_BUILD_LOGS"
BUILD_EVENTS_STREAM = "ZATTERA_BUILD_EVENTS"

SOURCES_STORE = "zattera-sources"
IMAGES_STORE = "zattera-images"
SNAPSHOTS_STORE = "zattera-snapshots"

DAY = 24 * 3600.0


def build_log_subject(build_id: str) -> str:
    return f"zattera.builds.{build_id}.log"


def build_events_subject(build_id: str, node_id: str = "*") -> str:
    """Events of ``build_id`` sent by the builder on ``node_id`` (``*``: from any node). The node token is
    permission-enforced (a builder may publish only its own, SECURITY.md): the dispatcher accepts a build's
    events only from the node the build was assigned to."""
    return f"zattera.builds.{build_id}.events.{node_id}"


def agent_subject(node_id: str, verb: str) -> str:
    return f"zattera.agent.{node_id}.{verb}"


INBOX_PREFIX = "_INBOX."


def is_direct_request(msg: Msg) -> bool:
    """True when ``msg`` was published by a client as a request (reply to one of its inboxes).

    nats-server delivers JetStream API replies and consumer deliveries to whatever subject the requester
    names, without checking that requester's publish rights (SECURITY.md, "Open"): such a redirected
    message arrives with no reply subject (an API reply) or a ``$JS.ACK`` one (a delivery). Handlers that
    act on requests (an agent's snapshot, restore, prune and build subjects) only act on direct ones.
    A request that crossed an account import (SECURITY.md, role accounts) has a server-made ``_R_.`` reply."""
    return msg.reply.startswith((INBOX_PREFIX, "_R_."))


def split_urls(urls: str | list[str]) -> list[str]:
    if isinstance(urls, list):
        return urls
    return [u.strip() for u in urls.split(",") if u.strip()]


ConnectionListener = Callable[[], Awaitable[None]]

JS_API_PREFIX = "$JS.API."
RETRY_PAUSE = 0.25
FIRST_ATTEMPT_TIMEOUT = 1.0
LONGEST_ATTEMPT_TIMEOUT = 2.0
"""Attempts wait 1 s, then 2 s each: a request sent during a leader election is never answered, so an
attempt waiting longer only delays the first one sent after the election (up to 9 s after the loss)."""


class ClusterUnavailable(ZatteraError, ConnectionError):
    """JetStream did not answer a request within the bounded wait: the message names what was waited for
    and the servers tried."""


class NotAuthorized(ZatteraError):
    """The server refused the connection's credential (none given to a secured server, an unknown, expired or
    revoked one): the message names the credential and the server's reason. Retrying the same credential
    cannot help, so :func:`connect` raises it at once."""


class PermissionDenied(ZatteraError):
    """The server refused a publish or subscribe of this credential (a permissions violation): the message
    names the credential and the subject it may not use. Raised at once instead of waiting for an answer
    that cannot come."""


_AUTH_REFUSALS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
    "authentication timeout",
)
_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"]+)\"?", re.IGNORECASE)


def describe_credential(creds: str | None) -> str:
    """How errors name a connection's credential: its file and the user it holds, or that there is none."""
    if not creds:
        return "no credential (none given: ZATTERA_NATS_CREDS, --creds of a context)"
    try:
        from shared.security.creds import read_user_jwt
        from shared.security.nkeyjwt import decode_claims

        claims = decode_claims(read_user_jwt(creds))
    except (OSError, ValueError, KeyError):
        return f"the credential {creds}"
    return f"the credential {creds} (user {claims.get('name', '?')!r}, {str(claims.get('sub', '?'))[:12]}…)"


def _auth_refusal(exc: BaseException) -> str | None:
    """The server's reason when ``exc`` is a refused credential (nats-py reports it as a plain error)."""
    text = str(exc).lower()
    return next((reason for reason in _AUTH_REFUSALS if reason in text), None)


def permission_violation(exc: BaseException) -> tuple[str, str] | None:
    """(``publish`` | ``subscribe``, subject lower-cased as nats-py reports it) of a permissions violation."""
    match = _VIOLATION.search(str(exc))
    if match is None:
        return None
    return ("publish" if match.group(1).lower() == "publish" else "subscribe"), match.group(2).lower()


def _unavailable_reply(msg: Msg) -> bool:
    """A JetStream API reply of ``503`` (no stream/meta leader yet: an election is under way)."""
    if b'"code":503' not in msg.data:
        return False
    try:
        return int(json.loads(msg.data).get("error", {}).get("code", 0)) == 503
    except (ValueError, AttributeError):
        return False


class PatientClient(NATS):
    """A client whose JetStream API requests ride out the loss of a server: a request that times out, finds
    no responder or gets ``503`` (a leader election), or whose server drops the connection while it waits,
    is sent again — to whichever server the client has reconnected to — until ``request_deadline``
    seconds have passed; then :class:`ClusterUnavailable`. A request to a stream whose leader just died gets
    no answer at all, even after the election, so attempts are short — 1 s, then 2 s each (a slow but live
    answer still arrives) — and the first one sent after the election is answered.
    Publishes (writes) are never repeated: a write whose reply was lost is the caller's to check
    (``shared.txn.CommitUnknown``)."""

    def __init__(self, request_deadline: float, credential: str = "") -> None:
        super().__init__()
        self.request_deadline = request_deadline
        self.credential = credential
        """What :class:`PermissionDenied` names (:func:`describe_credential`)."""
        self.denied: dict[str, str] = {}
        """Subject (lower-cased) → "publish"/"subscribe" that the server refused this connection."""

    def note_error(self, exc: BaseException) -> None:
        """An asynchronous error from the server: a permissions violation fails the request it concerns."""
        violation = permission_violation(exc)
        if violation is not None:
            self.denied[violation[1]] = violation[0]

    def _denial(self, subject: str) -> PermissionDenied | None:
        verb = self.denied.get(subject.lower())
        if verb is None:
            return None
        return PermissionDenied(
            f"NATS refused {self.credential or 'this connection'}: it may not {verb} to {subject} "
            "(permissions violation)"
        )

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        if not subject.startswith(JS_API_PREFIX):
            try:
                return await super().request(subject, payload, timeout, old_style, headers)
            except (nats.errors.TimeoutError, TimeoutError):
                if (denial := self._denial(subject)) is not None:
                    raise denial from None
                raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.request_deadline, timeout)
        tried: list[str] = []
        last = "no attempt"
        attempt_timeout = FIRST_ATTEMPT_TIMEOUT
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                what = subject[len(JS_API_PREFIX) :]
                raise ClusterUnavailable(
                    f"no answer from JetStream to {what} within {self.request_deadline:.0f}s ({last}); "
                    f"servers tried: {', '.join(tried) or 'none'}"
                )
            server = self.connected_url
            if server is not None and server.netloc not in tried:
                tried.append(server.netloc)
            reconnects = self.stats["reconnects"]
            attempt = asyncio.ensure_future(
                super().request(subject, payload, min(timeout, attempt_timeout, remaining), old_style, headers)
            )
            attempt_timeout = min(attempt_timeout * 2, LONGEST_ATTEMPT_TIMEOUT)
            try:
                msg = await self._unless_reconnected(attempt, reconnects, subject)
            except (nats.errors.TimeoutError, TimeoutError):
                last = "timed out"
                continue
            except (
                nats.errors.NoRespondersError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.StaleConnectionError,
                nats.errors.OutboundBufferLimitError,
            ) as exc:
                last = str(exc) or type(exc).__name__
            else:
                if msg is None:
                    last = "connection lost"
                    continue
                if not _unavailable_reply(msg):
                    return msg
                last = "JetStream unavailable (503)"
            await asyncio.sleep(min(RETRY_PAUSE, max(0.0, deadline - loop.time())))

    async def _unless_reconnected(self, attempt: asyncio.Future[Msg], reconnects: int, subject: str) -> Msg | None:
        """The attempt's reply, or None as soon as the client has reconnected (the reply, if any, went to
        the server that was lost); :class:`PermissionDenied` as soon as the server refused the subject."""
        while True:
            if (denial := self._denial(subject)) is not None:
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.Error, TimeoutError):
                    await attempt
                raise denial
            try:
                done, _ = await asyncio.wait({attempt}, timeout=0.1)
            except asyncio.CancelledError:  # the caller gave up (e.g. the CLI's snapshot answered first)
                attempt.cancel()
                raise
            if done:
                return attempt.result()
            if self.stats["reconnects"] != reconnects:
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.Error, TimeoutError):
                    await attempt
                return None


@dataclass
class Connection:
    """A NATS connection plus reconnect listeners (the state view resyncs on reconnect)."""

    nc: NATS
    js: JetStreamContext
    _on_reconnect: list[ConnectionListener]
    _on_disconnect: list[ConnectionListener]
    closing: bool = False
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the connection closed for good without :meth:`close` (e.g. the server dropped it over a
    protocol error: nats-py then never reconnects). A process left like that is alive but deaf; its
    entry point exits instead, so that a supervisor restarts it."""

    def on_reconnect(self, cb: ConnectionListener) -> None:
        self._on_reconnect.append(cb)

    def on_disconnect(self, cb: ConnectionListener) -> None:
        self._on_disconnect.append(cb)

    async def close(self) -> None:
        self.closing = True
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=2)
        except (TimeoutError, nats.errors.Error, OSError):
            await self.nc.close()


async def connect(
    urls: str | list[str],
    name: str = "zattera",
    *,
    connect_timeout: float = 5.0,
    creds: str | None = None,
    tls_ca: str | None = None,
    request_deadline: float = 0.0,
    fail_fast: bool = False,
) -> Connection:
    """Connect with unlimited reconnects; the returned connection drains on close.

    ``creds``: a NATS credentials file (secured clusters, see SECURITY.md); the connection then uses the
    private inbox prefix that the role permissions allow. ``tls_ca``: the CA that must have signed the
    server certificate (TLS listener). ``request_deadline`` > 0: JetStream API requests are retried across
    servers that long (:class:`PatientClient`), and fail at once with :class:`PermissionDenied` when the
    server refuses the subject. A refused credential raises :class:`NotAuthorized` at once; ``fail_fast``
    (a command line): once every server was tried and none answered, ConnectionError without waiting for
    ``connect_timeout`` twice (services keep trying: they are retried with backoff).
    """
    on_reconnect: list[ConnectionListener] = []
    on_disconnect: list[ConnectionListener] = []
    holder: list[Connection] = []
    servers = split_urls(urls)
    _websocket_ready(servers)
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[Exception] = loop.create_future()
    failures: list[str] = []
    giving_up = False  # the first connect failed: nc.close() then calls the callbacks, which say nothing

    async def reconnected() -> None:
        log.info("nats reconnected", extra={"client": name})
        for cb in list(on_reconnect):
            await cb()

    async def disconnected() -> None:
        if giving_up or (holder and holder[0].closing):
            return
        log.warning("nats disconnected", extra={"client": name})
        for cb in list(on_disconnect):
            await cb()

    async def error(exc: Exception) -> None:
        log.debug("nats error: %s", exc)
        if isinstance(nc, PatientClient):
            nc.note_error(exc)
        if holder or refused.done():
            return
        reason = _auth_refusal(exc)
        if reason is not None:
            refused.set_result(NotAuthorized(f"NATS at {urls} refused {describe_credential(creds)}: {reason}"))
            return
        failures.append(str(exc) or type(exc).__name__)
        if fail_fast and len(failures) >= len(servers):
            refused.set_result(ConnectionError(f"no NATS server reachable at {urls} ({failures[-1]})"))

    async def closed() -> None:
        if holder and not holder[0].closing:
            log.error("nats connection closed for good", extra={"client": name})
            holder[0].lost.set()

    nc = PatientClient(request_deadline, describe_credential(creds)) if request_deadline > 0 else NATS()
    # nats-py retries the initial connect forever when reconnects are unlimited: bound it here and let
    # the caller decide how to back off.
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name,
            connect_timeout=max(1, int(connect_timeout)),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int, used as float seconds
            allow_reconnect=True,
            reconnected_cb=reconnected,
            disconnected_cb=disconnected,
            closed_cb=closed,
            error_cb=error,
            pending_size=64 * 1024 * 1024,
            flush_timeout=10,
            **_security_options(creds, tls_ca),
        )
    )
    either: set[asyncio.Future[Any]] = {connecting, refused}
    try:
        await asyncio.wait(either, timeout=connect_timeout * 2, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        giving_up = True
        await cancel_and_wait(connecting)
        await nc.close()
        raise
    failed = connecting.exception() if connecting.done() else None
    if not connecting.done() or failed is not None:
        giving_up = True
        await cancel_and_wait(connecting)
        await nc.close()
        if refused.done():
            raise refused.result()
        if failed is not None:
            raise failed
        seen = f" ({failures[-1]})" if failures else ""
        raise ConnectionError(f"no NATS server reachable at {urls}{seen}") from None
    conn = Connection(nc=nc, js=nc.jetstream(timeout=10), _on_reconnect=on_reconnect, _on_disconnect=on_disconnect)
    holder.append(conn)
    return conn


def _websocket_ready(servers: list[str]) -> None:
    """Give nats-py's websocket transport aiohttp when a server URL needs it (the CLI imports nats-py without
    it: cli/main.py)."""
    if not any(server.split("://", 1)[0] in ("ws", "wss") for server in servers):
        return
    import aiohttp
    import multidict
    import nats.aio.transport as transport

    if getattr(transport, "aiohttp", None) is None:
        setattr(transport, "aiohttp", aiohttp)  # noqa: B010  # the names the transport reads at run time
        setattr(transport, "multidict", multidict)  # noqa: B010


def _security_options(creds: str | None, tls_ca: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if creds:
        from shared.security.creds import inbox_prefix

        options["user_credentials"] = creds
        options["inbox_prefix"] = inbox_prefix(creds)
    if tls_ca:
        options["tls"] = ssl.create_default_context(cafile=tls_ca)
    return options


def state_stream_config(replicas: int, tombstone_ttl: float) -> StreamConfig:
    return StreamConfig(
        name=STATE_STREAM,
        subjects=[f"{STATE_PREFIX}>"],
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_rollup_hdrs=True,
        deny_delete=True,
        allow_direct=True,
        duplicate_window=120.0,
        allow_msg_ttl=True,
        allow_atomic=True,
        subject_delete_marker_ttl=tombstone_ttl,
    )


def live_stream_config(replicas: int, ttl: float) -> StreamConfig:
    return StreamConfig(
        name=LIVE_STREAM,
        subjects=[f"{LIVE_PREFIX}>"],
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        storage=StorageType.MEMORY,
        num_replicas=replicas,
        # Agents and proxies write here (their own keys): a rollup header from one would wipe every key.
        allow_rollup_hdrs=False,
        deny_delete=True,
        allow_direct=True,
        max_age=ttl,
        duplicate_window=min(ttl, 120.0),
        allow_msg_ttl=True,
    )


def event_stream_config(replicas: int) -> StreamConfig:
    return StreamConfig(
        name=EVENTS_STREAM,
        subjects=[f"{EVENTS_SUBJECT_PREFIX}>"],
        max_msgs=100_000,
        max_age=7 * DAY,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
    )


def routes_stream_config(replicas: int) -> StreamConfig:
    return StreamConfig(
        name=ROUTES_STREAM,
        subjects=[ROUTES_SNAPSHOT_SUBJECT],
        max_msgs_per_subject=1,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
        max_msg_size=-1,
    )


BUILD_LOG_END_SLOTS = 1
"""Messages of a build's log subject that are not log lines: the dispatcher's end marker."""


def build_logs_stream_config(replicas: int, lines_per_build: int = 10_000) -> StreamConfig:
    """``lines_per_build`` log lines per build are kept, plus the end marker (its own slot, so a long
    build still keeps exactly ``lines_per_build`` lines once it has ended)."""
    return StreamConfig(
        name=BUILD_LOGS_STREAM,
        subjects=["zattera.builds.*.log"],
        max_msgs_per_subject=lines_per_build + BUILD_LOG_END_SLOTS,
        max_age=30 * DAY,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
    )


def build_events_stream_config(replicas: int) -> StreamConfig:
    """Builder events are kept until the dispatcher records the outcome (it then purges the build's subject),
    so a new dispatcher leader replays what it missed during a failover instead of losing a build's result."""
    return StreamConfig(
        name=BUILD_EVENTS_STREAM,
        subjects=[build_events_subject("*")],
        max_msgs_per_subject=50_000,
        max_age=DAY,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
    )


CONFIG_METADATA_PREFIX = "zattera."
"""The cluster configuration is recorded in the state stream's metadata (keys ``zattera.<field>``): it is
created with the stream, atomically, by the one init that wins; nothing ever rewrites it."""

STREAM_FIELDS_CHECKED = (
    "num_replicas",
    "storage",
    "subjects",
    "max_msgs_per_subject",
    "max_age",
    "allow_atomic",
    "allow_msg_ttl",
    "subject_delete_marker_ttl",
)


def default_replicas(cluster_size: int) -> int:
    """Three copies on a cluster of three servers or more, one otherwise (R2 survives no loss either)."""
    return 3 if cluster_size >= 3 else 1


def cluster_size(nc: NATS) -> int:
    """Servers of the cluster the connection is on: the client URLs its server advertises (INFO
    ``connect_urls`` lists every member's, its own included), or the servers the caller named, whichever
    is more (right after a cluster starts, a server's first INFO may not list peers whose routes are still
    connecting); 1 for a lone server."""
    info = nc._server_info
    if not info.get("cluster"):
        return 1
    named = {(srv.uri.hostname, srv.uri.port) for srv in nc._server_pool if not srv.discovered}
    return max(1, len(info.get("connect_urls") or []), len(named))


SCHEMA_KEY = f"{CONFIG_METADATA_PREFIX}schema"
VERSION_KEY = f"{CONFIG_METADATA_PREFIX}version"
MIGRATION_KEY_PREFIX = f"{CONFIG_METADATA_PREFIX}migration."
"""``zattera.migration.<NNNN>`` = ``<when> <version> <what it changed>``: one per migration the cluster ran."""


@dataclass(frozen=True)
class ClusterConfig:
    """What every stream, bucket and object store is created with: chosen once, by the init; and the schema
    the cluster is at, with the Zattera version that brought it there (docs/upgrades.md)."""

    replicas: int = 1
    live_ttl: float = LIVE_TTL
    tombstone_ttl: float = TOMBSTONE_TTL
    build_log_lines: int = 10_000
    initialized_at: str = ""
    schema: int = 0
    """The schema version (``shared/migrations``); 0: recorded by a release before schemas were (0.1.0)."""
    version: str = ""
    """The Zattera version that initialised the cluster or last upgraded it ("" before 0.2.0)."""
    migrations: tuple[str, ...] = ()
    """What each migration run on this cluster did, in order: ``<NNNN> <when> <version> <changes>``."""
    cluster_id: str = ""
    """A ULID chosen by the init that created the state stream: which cluster this is (route snapshots
    name it, :func:`cluster_identity`); "" for a cluster initialised before ids were recorded."""

    def metadata(self) -> dict[str, str]:
        recorded = {
            f"{CONFIG_METADATA_PREFIX}replicas": str(self.replicas),
            f"{CONFIG_METADATA_PREFIX}live_ttl": repr(self.live_ttl),
            f"{CONFIG_METADATA_PREFIX}tombstone_ttl": repr(self.tombstone_ttl),
            f"{CONFIG_METADATA_PREFIX}build_log_lines": str(self.build_log_lines),
            f"{CONFIG_METADATA_PREFIX}initialized_at": self.initialized_at,
            SCHEMA_KEY: str(self.schema),
            VERSION_KEY: self.version,
        }
        for line in self.migrations:
            number, _, rest = line.partition(" ")
            recorded[f"{MIGRATION_KEY_PREFIX}{number}"] = rest
        if self.cluster_id:  # left out when unknown, so that rewriting the metadata never erases a recorded one
            recorded[f"{CONFIG_METADATA_PREFIX}cluster_id"] = self.cluster_id
        return recorded

    @classmethod
    def recorded(cls, state: StreamConfig) -> ClusterConfig:
        """The configuration recorded on the state stream; a cluster provisioned before it was recorded
        (no metadata) is described by its state stream as it is."""
        return cls.from_metadata(state.metadata or {}, state.num_replicas or 1, state.subject_delete_marker_ttl)

    @classmethod
    def from_metadata(
        cls, meta: dict[str, str], replicas: int = 1, tombstone_ttl: float | None = None
    ) -> ClusterConfig:
        """The configuration in a state stream's metadata; ``replicas`` and ``tombstone_ttl`` (the stream's
        own) describe a cluster provisioned before it was recorded."""
        if f"{CONFIG_METADATA_PREFIX}replicas" not in meta:
            return cls(replicas=replicas, tombstone_ttl=tombstone_ttl or 900.0)

        def get(name: str) -> str:
            return meta.get(f"{CONFIG_METADATA_PREFIX}{name}", "")

        return cls(
            replicas=int(get("replicas")),
            live_ttl=float(get("live_ttl") or 60.0),
            tombstone_ttl=float(get("tombstone_ttl") or 900.0),
            build_log_lines=int(get("build_log_lines") or 10_000),
            initialized_at=get("initialized_at"),
            schema=int(meta.get(SCHEMA_KEY) or 0),
            version=meta.get(VERSION_KEY, ""),
            migrations=tuple(
                f"{key.removeprefix(MIGRATION_KEY_PREFIX)} {value}"
                for key, value in sorted(meta.items())
                if key.startswith(MIGRATION_KEY_PREFIX)
            ),
            cluster_id=get("cluster_id"),
        )

    def stream_configs(self) -> list[StreamConfig]:
        state = state_stream_config(self.replicas, self.tombstone_ttl)
        state.metadata = self.metadata()
        return [
            state,
            live_stream_config(self.replicas, self.live_ttl),
            event_stream_config(self.replicas),
            routes_stream_config(self.replicas),
            build_logs_stream_config(self.replicas, self.build_log_lines),
            build_events_stream_config(self.replicas),
        ]


OBJECT_STORES = (SOURCES_STORE, IMAGES_STORE, SNAPSHOTS_STORE)


def object_store_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


@dataclass
class ProvisionReport:
    """What :func:`provision` found: the recorded configuration, what it created, and every difference
    between an existing stream and that configuration (reported, never applied)."""

    config: ClusterConfig
    created: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    initialized: bool = False


def _normalised(cfg: StreamConfig, name: str) -> object:
    value = getattr(cfg, name)
    if name in ("max_age", "subject_delete_marker_ttl"):
        return round(float(value or 0), 3)
    if name in ("allow_atomic", "allow_msg_ttl"):
        return bool(value)
    if name == "storage":
        return str(getattr(value, "value", value) or "file")
    return value


def stream_mismatches(want: StreamConfig, have: StreamConfig) -> list[str]:
    """``"<stream>: <field> is <have>, recorded <want>"`` for each checked field that differs."""
    return [
        f"{want.name}: {name} is {_normalised(have, name)}, recorded {_normalised(want, name)}"
        for name in STREAM_FIELDS_CHECKED
        if _normalised(have, name) != _normalised(want, name)
    ]


async def _stream_config(js: JetStreamContext, name: str) -> StreamConfig | None:
    try:
        return (await js.stream_info(name)).config
    except NotFoundError:
        return None


placement_log = logging.getLogger(f"{__name__}.placement")
"""Where :func:`until_placed` says it waits (``zattera cluster init`` shows it on stderr)."""
NO_PEERS_FOR_PLACEMENT = 10005
"""JetStream's "no suitable peers for placement": fewer current servers than the replicas asked for."""
PLACEMENT_PATIENCE = 30.0
"""How long a stream's creation waits for enough servers: a cluster's servers started together all join
its meta group within seconds, a server that is down does not (then the refusal stands, named)."""


async def until_placed(create: Callable[[], Awaitable[T]], what: str, patience: float = PLACEMENT_PATIENCE) -> T:
    """``create()``, sent again while JetStream refuses it for want of peers: right after the servers start
    (``zattera up``, a fresh cluster), the meta group can know fewer of them than the replicas asked for.
    After ``patience``, :class:`ClusterUnavailable` naming what could not be placed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    attempt = 0
    while True:
        try:
            return await create()
        except APIError as exc:
            if exc.err_code != NO_PEERS_FOR_PLACEMENT:
                raise
            if loop.time() >= deadline:
                raise ClusterUnavailable(
                    f"{what}: {exc.description} after {patience:.0f}s: fewer JetStream servers are up than the "
                    "copies it needs (`zattera cluster status`; start the missing servers)"
                ) from exc
            attempt += 1
            if attempt == 1:
                placement_log.info(
                    "%s: %s; waiting up to %.0fs for the cluster's servers", what, exc.description, patience
                )
        await asyncio.sleep(min(exponential(0.25, attempt, 2.0), max(0.0, deadline - loop.time())))


async def create_stream_if_missing(js: JetStreamContext, cfg: StreamConfig) -> tuple[StreamConfig, bool]:
    """The stream's configuration, creating it from ``cfg`` when it does not exist; True when created here.
    An existing stream is never updated (safe from many processes: a concurrent creator wins)."""
    assert cfg.name is not None
    existing = await _stream_config(js, cfg.name)
    if existing is not None:
        return existing, False
    try:
        await until_placed(lambda: js.add_stream(cfg), cfg.name)
        return cfg, True
    except BadRequestError as exc:
        if exc.err_code != 10058:  # created concurrently, with another configuration: that one stands
            raise
    existing = await _stream_config(js, cfg.name)
    if existing is None:
        raise NotFoundError(description=f"stream {cfg.name} vanished while being created")
    return existing, False


async def create_object_store_if_missing(js: JetStreamContext, bucket: str, replicas: int) -> tuple[int, bool]:
    """The object store's replica count, creating the store when it does not exist; True when created here."""
    existing = await _stream_config(js, object_store_stream(bucket))
    if existing is not None:
        return existing.num_replicas or 1, False
    try:
        config = ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas)
        await until_placed(lambda: js.create_object_store(bucket, config), object_store_stream(bucket))
        return replicas, True
    except BadRequestError as exc:
        if exc.err_code != 10058:
            raise
    existing = await _stream_config(js, object_store_stream(bucket))
    return (existing.num_replicas or 1) if existing else replicas, False


async def create_or_update_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create the stream, or update it in place when it exists. Only for streams one leader loop owns and
    sizes (an env's instance-log stream, whose retention follows its spec); the cluster's own streams go
    through :func:`provision`, which never changes what exists."""
    assert cfg.name is not None
    try:
        await js.stream_info(cfg.name)
    except NotFoundError:
        try:
            await js.add_stream(cfg)
            return
        except BadRequestError as exc:
            if exc.err_code != 10058:  # created concurrently by another process: fall through to update
                raise
    await js.update_stream(cfg)


@dataclass(frozen=True)
class ClusterIdentity:
    """Which cluster, and which life of its state stream: ``id`` recorded by the init (:attr:`ClusterConfig.
    cluster_id`), ``epoch`` the state stream's creation time. State revisions — hence route snapshot
    versions — are comparable only between equal identities (a data dir started ``--secure`` after an open
    cluster, a state stream created anew: versions start over)."""

    id: str
    epoch: str


async def cluster_identity(js: JetStreamContext) -> ClusterIdentity:
    """The identity of the cluster ``js`` is connected to (read from the state stream; NotFoundError when
    the cluster is not initialised)."""
    info = await js.stream_info(STATE_STREAM)
    created = info.created.astimezone(UTC).isoformat() if info.created is not None else ""
    return ClusterIdentity(ClusterConfig.recorded(info.config).cluster_id, created)


async def recorded_replicas(js: JetStreamContext) -> int:
    """The replica count the cluster's init recorded (what streams created later must use)."""
    state = await _stream_config(js, STATE_STREAM)
    return ClusterConfig.recorded(state).replicas if state is not None else 1


async def recorded_config(js: JetStreamContext) -> ClusterConfig | None:
    """The recorded cluster configuration, schema and version included; None: not initialised."""
    state = await _stream_config(js, STATE_STREAM)
    return ClusterConfig.recorded(state) if state is not None else None


async def js_api(nc: NATS, what: str, payload: dict[str, Any] | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """One JetStream API request (``what``: ``STREAM.INFO.<name>``…) with a JSON body, its JSON reply; an
    error reply raises nats-py's :class:`APIError` subclass for it (``NotFoundError``…)."""
    body = json.dumps(payload).encode() if payload is not None else b""
    reply: dict[str, Any] = json.loads((await nc.request(JS_API_PREFIX + what, body, timeout=timeout)).data)
    if "error" in reply:
        APIError.from_error(reply["error"])
    return reply


async def raw_stream_config(nc: NATS, name: str) -> dict[str, Any] | None:
    """A stream's configuration as the server has it (every field, nats-py's model or not); None: none."""
    try:
        config: dict[str, Any] = (await js_api(nc, f"STREAM.INFO.{name}"))["config"]
    except NotFoundError:
        return None
    return config


async def update_stream_raw(nc: NATS, config: dict[str, Any]) -> dict[str, Any]:
    """Replace a stream's configuration with ``config`` (read by :func:`raw_stream_config` and edited: what
    the caller did not touch goes back as the server had it). Only migrations change existing streams."""
    config = {k: v for k, v in config.items() if k != "metadata"} | {
        # nats-server keeps its own ``_nats.*`` keys; sending them back is refused by some versions
        "metadata": {k: v for k, v in (config.get("metadata") or {}).items() if not k.startswith("_nats.")}
    }
    updated: dict[str, Any] = (await js_api(nc, f"STREAM.UPDATE.{config['name']}", config))["config"]
    return updated


async def provision(
    js: JetStreamContext,
    *,
    replicas: int | None = None,
    live_ttl: float = LIVE_TTL,
    tombstone_ttl: float = TOMBSTONE_TTL,
    build_log_lines: int = 10_000,
) -> ProvisionReport:
    """Create what is missing of the buckets, streams and object stores, never changing what exists.
    Idempotent; safe from many processes at once.

    On an uninitialised cluster (no state stream) this is the init: the configuration — ``replicas``, or
    :func:`default_replicas` of the cluster's size when None, and the TTLs given — is recorded on the
    state stream as it is created. Everything else is then created from the RECORDED configuration, so a
    caller with other settings (another replica count, TTLs) creates the same streams and changes none;
    each difference between an existing stream and the recorded configuration is returned and logged.
    """
    size = cluster_size(js._nc)
    wanted = ClusterConfig(
        replicas=replicas or default_replicas(size),
        live_ttl=live_ttl,
        tombstone_ttl=tombstone_ttl,
        build_log_lines=build_log_lines,
        initialized_at=datetime.now(UTC).isoformat(timespec="seconds"),
        schema=SCHEMA,  # a new cluster is created as this code defines it: no migration has anything to do
        version=VERSION,
        cluster_id=new_id(),
    )
    state, created = await create_stream_if_missing(js, wanted.stream_configs()[0])
    config = ClusterConfig.recorded(state)
    report = ProvisionReport(config=config, initialized=created)
    if created:
        report.created.append(STATE_STREAM)
        log.info(
            "cluster initialised: replicas=%d (cluster of %d servers), schema %d (Zattera %s)",
            config.replicas,
            size,
            config.schema,
            config.version,
        )
    elif replicas is not None and replicas != config.replicas:
        report.mismatches.append(f"replicas {replicas} requested, recorded {config.replicas}: not applied")
    for want in config.stream_configs():
        have, made = await create_stream_if_missing(js, want)
        if made and want.name != STATE_STREAM:
            report.created.append(str(want.name))
        want.metadata = None
        report.mismatches.extend(stream_mismatches(want, have))
    for bucket in OBJECT_STORES:
        have_replicas, made = await create_object_store_if_missing(js, bucket, config.replicas)
        if made:
            report.created.append(object_store_stream(bucket))
        if have_replicas != config.replicas:
            report.mismatches.append(
                f"{object_store_stream(bucket)}: num_replicas is {have_replicas}, recorded {config.replicas}"
            )
    if config.schema < SCHEMA and report.mismatches:
        # The upgrade that follows provisioning (shared/migrations) changes what its migrations change.
        log.info(
            "cluster at schema %d, this code's is %d: differences before the upgrade: %s",
            config.schema,
            SCHEMA,
            "; ".join(report.mismatches),
        )
    else:
        for mismatch in report.mismatches:
            log.warning("cluster configuration mismatch (not applied): %s", mismatch)
    return report


class ProvisionSettings(Protocol):
    replicas: int
    live_ttl: float
    tombstone_ttl: float


def provision_options(cfg: ProvisionSettings) -> dict[str, Any]:
    """:func:`provision` arguments from a process's settings: they only matter to an uninitialised cluster
    (``ZATTERA_REPLICAS=0``, the default, derives the replica count from the cluster's size)."""
    return {"replicas": cfg.replicas or None, "live_ttl": cfg.live_ttl, "tombstone_ttl": cfg.tombstone_ttl}


@dataclass
class StreamStatus:
    """One stream (or object store's stream) as ``zattera cluster status`` shows it."""

    name: str
    exists: bool
    replicas: int = 0
    leader: str = ""
    peers: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


async def inspect_cluster(js: JetStreamContext) -> tuple[ClusterConfig | None, list[StreamStatus]]:
    """The recorded configuration (None: not initialised) and every stream against it; read-only."""
    state = await _stream_config(js, STATE_STREAM)
    if state is None:
        return None, []
    config = ClusterConfig.recorded(state)
    wanted: dict[str, StreamConfig | None] = {str(c.name): c for c in config.stream_configs()}
    wanted.update({object_store_stream(bucket): None for bucket in OBJECT_STORES})
    found = []
    for name, want in wanted.items():
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            found.append(StreamStatus(name, exists=False, mismatches=[f"{name}: missing"]))
            continue
        replicas = info.config.num_replicas or 1
        if want is not None:
            want.metadata = None
            mismatches = stream_mismatches(want, info.config)
        elif replicas != config.replicas:  # an object store: only its replica count is ours
            mismatches = [f"{name}: num_replicas is {replicas}, recorded {config.replicas}"]
        else:
            mismatches = []
        cluster = info.cluster
        peers = (
            [f"{p.name}{'' if p.current else ' (catching up)'}" for p in (cluster.replicas or [])] if cluster else []
        )
        leader = (cluster.leader or "") if cluster else ""
        found.append(StreamStatus(name, True, replicas, leader, peers, mismatches))
    return config, found


DIRECT_GET_PREFIX = f"{JS_API_PREFIX}DIRECT.GET."
DIRECT_GET_STATUS = "Status"
END_OF_BATCH = "204"
NO_RESULTS = "404"
TOO_MANY_RESULTS = "413"


class TooManySubjects(ZatteraError):
    """More subjects than the server returns in one ``multi_last`` direct get (1,024 in nats-server)."""


async def last_per_subject(nc: NATS, stream: str, subjects: str, timeout: float) -> list[Msg]:
    """The last message of every subject matching ``subjects`` (deletes and markers included), read with ONE
    ``DIRECT.GET`` batch request (``multi_last``): answered by any current replica of a stream that allows
    direct reads, so without a consumer and without its leader — it works while the stream elects one.
    The reply is one point in the stream's history. Raises :class:`TimeoutError` when no message arrives
    within ``timeout`` of the last, ``nats.errors.NoRespondersError`` / :class:`ClusterUnavailable` when
    nobody answers (no replica: an election's first instants, or no such stream), :class:`TooManySubjects`."""
    inbox = nc.new_inbox()
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        replies.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        request = json.dumps({"multi_last": [subjects]}).encode()
        await nc.publish(DIRECT_GET_PREFIX + stream, request, reply=inbox)
        found: list[Msg] = []
        while True:
            msg = await asyncio.wait_for(replies.get(), timeout)
            status = (msg.headers or {}).get(DIRECT_GET_STATUS)
            if status is None:
                found.append(msg)
            elif status in (END_OF_BATCH, NO_RESULTS):
                return found
            elif status == TOO_MANY_RESULTS:
                raise TooManySubjects(f"{stream}: more subjects than one direct get returns")
            elif status == "503" and not found:
                raise nats.errors.NoRespondersError
            else:
                raise ClusterUnavailable(f"direct get of {stream} answered {status} {msg.headers}")
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
