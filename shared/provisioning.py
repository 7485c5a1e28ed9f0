"""Provisioning of every bucket, stream and object store: created when missing from the configuration
recorded in the cluster, never updated (migrations do; docs/cluster.md), and the cluster's inspection."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    ObjectStoreConfig,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shared.backoff import exponential
from shared.connection import ClusterUnavailable
from shared.defaults import LIVE_TTL, TOMBSTONE_TTL
from shared.ids import new_id
from shared.migrations.registry import SCHEMA
from shared.streams import (
    AUDIT_MAX_AGE,
    OBJECT_STORES,
    ClusterConfig,
    default_replicas,
    object_store_stream,
    stream_mismatches,
)
from shared.subjects import JS_API_PREFIX, STATE_STREAM
from shared.version import VERSION


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


@dataclass
class ProvisionReport:
    """What :func:`provision` found: the recorded configuration, what it created, and every difference
    between an existing stream and that configuration (reported, never applied)."""

    config: ClusterConfig
    created: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    initialized: bool = False


async def _stream_config(js: JetStreamContext, name: str) -> StreamConfig | None:
    try:
        return (await js.stream_info(name)).config
    except NotFoundError:
        return None


log = logging.getLogger(__name__)
T = TypeVar("T")

placement_log = logging.getLogger(f"{__name__}.placement")
"""Where :func:`until_placed` says it waits (``zattera cluster init`` shows it on stderr)."""

NO_PEERS_FOR_PLACEMENT = 10005
"""JetStream's "no suitable peers for placement": fewer current servers than the replicas asked for."""
STORE_NOT_CREATED = 10049
"""JetStream's "error creating store for stream" (500): seen on a cluster whose servers had just formed it, a
server's store directory not there yet; the same request a moment later succeeds."""
PLACEMENT_PATIENCE = 30.0
"""How long a stream's creation waits for enough servers: a cluster's servers started together all join
its meta group within seconds, a server that is down does not (then the refusal stands, named)."""


async def until_placed(create: Callable[[], Awaitable[T]], what: str, patience: float = PLACEMENT_PATIENCE) -> T:
    """``create()``, sent again while JetStream refuses it for want of peers — right after the servers start
    (``zattera up``, a fresh cluster), the meta group can know fewer of them than the replicas asked for — or
    because a server could not create the stream's store yet (:data:`STORE_NOT_CREATED`), or when the request
    gets no answer (the meta group still electing its leader).
    After ``patience``, :class:`ClusterUnavailable` naming what could not be placed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    attempt = 0
    while True:
        try:
            return await create()
        except nats.errors.TimeoutError as exc:
            # No answer: a fresh cluster's meta group may still be electing its leader. Asking again is safe: a
            # creation that did land answers the same request with its configuration.
            if loop.time() >= deadline:
                raise ClusterUnavailable(f"{what}: JetStream did not answer within {patience:.0f}s") from exc
            description = "no answer from JetStream yet"
        except APIError as exc:
            if exc.err_code not in (NO_PEERS_FOR_PLACEMENT, STORE_NOT_CREATED):
                raise
            if loop.time() >= deadline:
                raise ClusterUnavailable(
                    f"{what}: {exc.description} after {patience:.0f}s: fewer JetStream servers are up than the "
                    "copies it needs (`zattera cluster status`; start the missing servers)"
                ) from exc
            description = exc.description or ""
        attempt += 1
        if attempt == 1:
            placement_log.info("%s: %s; waiting up to %.0fs for the cluster's servers", what, description, patience)
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
    audit_max_age: float = AUDIT_MAX_AGE,
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
        audit_max_age=audit_max_age,
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
    return {
        "replicas": cfg.replicas or None,
        "live_ttl": cfg.live_ttl,
        "tombstone_ttl": cfg.tombstone_ttl,
        "audit_max_age": float(getattr(cfg, "audit_max_age", AUDIT_MAX_AGE)),
    }


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
