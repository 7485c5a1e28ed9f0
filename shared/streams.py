"""What every stream, bucket and object store is: its configuration (``ClusterConfig``, chosen once by the
init and recorded on the state stream's metadata) and how an existing stream differs from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nats.js.api import (
    DiscardPolicy,
    StorageType,
    StreamConfig,
)

from shared.defaults import LIVE_TTL, TOMBSTONE_TTL
from shared.subjects import (
    AUDIT_STREAM,
    AUDIT_SUBJECT_PREFIX,
    BUILD_EVENTS_STREAM,
    BUILD_LOGS_STREAM,
    EVENTS_STREAM,
    EVENTS_SUBJECT_PREFIX,
    IMAGES_STORE,
    LIVE_PREFIX,
    LIVE_STREAM,
    ROUTES_SNAPSHOT_SUBJECT,
    ROUTES_STREAM,
    SNAPSHOTS_STORE,
    SOURCES_STORE,
    STATE_PREFIX,
    STATE_STREAM,
    build_events_subject,
)

DAY = 24 * 3600.0


def _stream(name: str, subjects: list[str], replicas: int, **options: Any) -> StreamConfig:
    """A stream of the cluster: every one is replicated alike and readable by direct get; on file
    storage unless ``options`` says otherwise."""
    options.setdefault("storage", StorageType.FILE)
    return StreamConfig(name=name, subjects=subjects, num_replicas=replicas, allow_direct=True, **options)


def _keyed_stream(name: str, prefix: str, replicas: int, **options: Any) -> StreamConfig:
    """A stream that keeps one value per subject (a key): a write that would evict one is refused, no
    message is deleted by hand, and a write may carry its own time to live."""
    return _stream(
        name,
        [f"{prefix}>"],
        replicas,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        deny_delete=True,
        allow_msg_ttl=True,
        **options,
    )


def state_stream_config(replicas: int, tombstone_ttl: float) -> StreamConfig:
    return _keyed_stream(
        STATE_STREAM,
        STATE_PREFIX,
        replicas,
        allow_rollup_hdrs=True,
        duplicate_window=120.0,
        allow_atomic=True,
        subject_delete_marker_ttl=tombstone_ttl,
    )


def live_stream_config(replicas: int, ttl: float) -> StreamConfig:
    return _keyed_stream(
        LIVE_STREAM,
        LIVE_PREFIX,
        replicas,
        storage=StorageType.MEMORY,
        # Agents and proxies write here (their own keys): a rollup header from one would wipe every key.
        allow_rollup_hdrs=False,
        max_age=ttl,
        duplicate_window=min(ttl, 120.0),
    )


def event_stream_config(replicas: int) -> StreamConfig:
    return _stream(EVENTS_STREAM, [f"{EVENTS_SUBJECT_PREFIX}>"], replicas, max_msgs=100_000, max_age=7 * DAY)


def routes_stream_config(replicas: int) -> StreamConfig:
    return _stream(ROUTES_STREAM, [ROUTES_SNAPSHOT_SUBJECT], replicas, max_msgs_per_subject=1, max_msg_size=-1)


BUILD_LOG_END_SLOTS = 1
"""Messages of a build's log subject that are not log lines: the dispatcher's end marker."""


def build_logs_stream_config(replicas: int, lines_per_build: int = 10_000) -> StreamConfig:
    """``lines_per_build`` log lines per build are kept, plus the end marker (its own slot, so a long
    build still keeps exactly ``lines_per_build`` lines once it has ended)."""
    return _stream(
        BUILD_LOGS_STREAM,
        ["zattera.builds.*.log"],
        replicas,
        max_msgs_per_subject=lines_per_build + BUILD_LOG_END_SLOTS,
        max_age=30 * DAY,
    )


def build_events_stream_config(replicas: int) -> StreamConfig:
    """Builder events are kept until the dispatcher records the outcome (it then purges the build's subject),
    so a new dispatcher leader replays what it missed during a failover instead of losing a build's result."""
    return _stream(BUILD_EVENTS_STREAM, [build_events_subject("*")], replicas, max_msgs_per_subject=50_000, max_age=DAY)


AUDIT_MAX_AGE = 90 * DAY
"""How long audit entries are kept unless the init was told otherwise (``ZATTERA_AUDIT_MAX_AGE``)."""


def audit_stream_config(replicas: int, max_age: float = AUDIT_MAX_AGE) -> StreamConfig:
    """The audit log (docs/audit.md): append-only — no message is deleted and the stream is never purged,
    by anyone (the services included); entries leave only by age."""
    return _stream(
        AUDIT_STREAM,
        [f"{AUDIT_SUBJECT_PREFIX}>"],
        replicas,
        max_age=max_age,
        deny_delete=True,
        deny_purge=True,
        duplicate_window=120.0,
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
    audit_max_age: float = AUDIT_MAX_AGE
    """How long the audit log keeps an entry, seconds (``ZATTERA_AUDIT_MAX_AGE`` at the init)."""

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
        if self.audit_max_age != AUDIT_MAX_AGE:  # the default is not written (clusters older than the audit log)
            recorded[f"{CONFIG_METADATA_PREFIX}audit_max_age"] = repr(self.audit_max_age)
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
            audit_max_age=float(get("audit_max_age") or AUDIT_MAX_AGE),
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
            audit_stream_config(self.replicas, self.audit_max_age),
        ]


OBJECT_STORES = (SOURCES_STORE, IMAGES_STORE, SNAPSHOTS_STORE)


def object_store_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


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
