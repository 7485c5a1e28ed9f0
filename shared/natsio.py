"""NATS connection and idempotent provisioning of every bucket, stream and object store (DESIGN §2–§3)."""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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
from nats.js.errors import BadRequestError, NotFoundError

log = logging.getLogger(__name__)

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


def build_events_subject(build_id: str) -> str:
    return f"zattera.builds.{build_id}.events"


def agent_subject(node_id: str, verb: str) -> str:
    return f"zattera.agent.{node_id}.{verb}"


INBOX_PREFIX = "_INBOX."


def is_direct_request(msg: Msg) -> bool:
    """True when ``msg`` was published by a client as a request (reply to one of its inboxes).

    nats-server delivers JetStream API replies and consumer deliveries to whatever subject the requester
    names, without checking that requester's publish rights (SECURITY.md, "Open"): such a redirected
    message arrives with no reply subject (an API reply) or a ``$JS.ACK`` one (a delivery). Handlers that
    act on requests (an agent's snapshot, restore, prune and build subjects) only act on direct ones."""
    return msg.reply.startswith(INBOX_PREFIX)


def split_urls(urls: str | list[str]) -> list[str]:
    if isinstance(urls, list):
        return urls
    return [u.strip() for u in urls.split(",") if u.strip()]


ConnectionListener = Callable[[], Awaitable[None]]


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
) -> Connection:
    """Connect with unlimited reconnects; the returned connection drains on close.

    ``creds``: a NATS credentials file (secured clusters, see SECURITY.md); the connection then uses the
    private inbox prefix that the role permissions allow. ``tls_ca``: the CA that must have signed the
    server certificate (TLS listener).
    """
    on_reconnect: list[ConnectionListener] = []
    on_disconnect: list[ConnectionListener] = []
    holder: list[Connection] = []

    async def reconnected() -> None:
        log.info("nats reconnected", extra={"client": name})
        for cb in list(on_reconnect):
            await cb()

    async def disconnected() -> None:
        if holder and holder[0].closing:
            return
        log.warning("nats disconnected", extra={"client": name})
        for cb in list(on_disconnect):
            await cb()

    async def error(exc: Exception) -> None:
        log.debug("nats error: %s", exc)

    async def closed() -> None:
        if holder and not holder[0].closing:
            log.error("nats connection closed for good", extra={"client": name})
            holder[0].lost.set()

    nc = NATS()
    # nats-py retries the initial connect forever when reconnects are unlimited: bound it here and let
    # the caller decide how to back off.
    connecting = nc.connect(
        servers=split_urls(urls),
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
    try:
        await asyncio.wait_for(connecting, timeout=connect_timeout * 2)
    except TimeoutError:
        await nc.close()
        raise ConnectionError(f"no NATS server reachable at {urls}") from None
    conn = Connection(nc=nc, js=nc.jetstream(timeout=10), _on_reconnect=on_reconnect, _on_disconnect=on_disconnect)
    holder.append(conn)
    return conn


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
        allow_rollup_hdrs=True,
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
        subjects=["zattera.builds.*.events"],
        max_msgs_per_subject=50_000,
        max_age=DAY,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
    )


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create the stream, or update it in place when it exists (idempotent, safe from many processes)."""
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


async def ensure_object_store(js: JetStreamContext, bucket: str, replicas: int) -> None:
    try:
        await js.object_store(bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        try:
            await js.create_object_store(
                bucket, ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas)
            )
        except BadRequestError as exc:
            if exc.err_code != 10058:
                raise


async def provision(
    js: JetStreamContext,
    *,
    replicas: int = 1,
    live_ttl: float = 60.0,
    tombstone_ttl: float = 900.0,
    build_log_lines: int = 10_000,
) -> None:
    """Create or update everything of DESIGN §2–§3. Idempotent; every service calls it at start."""
    await ensure_stream(js, state_stream_config(replicas, tombstone_ttl))
    await ensure_stream(js, live_stream_config(replicas, live_ttl))
    await ensure_stream(js, event_stream_config(replicas))
    await ensure_stream(js, routes_stream_config(replicas))
    await ensure_stream(js, build_logs_stream_config(replicas, build_log_lines))
    await ensure_stream(js, build_events_stream_config(replicas))
    for bucket in (SOURCES_STORE, IMAGES_STORE, SNAPSHOTS_STORE):
        await ensure_object_store(js, bucket, replicas)
