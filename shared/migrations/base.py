"""What a migration is and what it may do: :class:`Migration` (one per module ``m<NNNN>_<name>.py``) and the
:class:`MigrationContext` its ``apply`` receives.

A migration is idempotent (run again on a cluster it has changed, it changes nothing) and resumable (a run
cut anywhere is finished by the next: the schema number is recorded only once ``apply`` returns). It runs
while its runner holds the ``lease.schema-upgrade`` lease; every helper below checks the lease before it
writes, and state writes are fenced by it. During a rolling upgrade the previous release still runs
against the migrated cluster: a migration only adds (streams, subjects, keys, fields) or changes what that
release does not rely on; removals wait for the release after (docs/upgrades.md, "Version skew").
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.api import KeyValueConfig, StorageType, StreamConfig

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.lease import Lease
from shared.migrations.registry import Listed
from shared.provisioning import (
    create_object_store_if_missing,
    create_stream_if_missing,
    raw_stream_config,
    until_placed,
    update_stream_raw,
)
from shared.state.feed import StateView
from shared.streams import ClusterConfig
from shared.txn import Writer

log = logging.getLogger(__name__)


class MigrationInterrupted(ZatteraError):
    """The runner lost its lease: another process runs the migrations now (this one writes nothing more)."""


@dataclass
class MigrationContext:
    """What a migration's ``apply`` works with. ``config`` is the recorded configuration (replicas, TTLs)
    that anything it creates must follow; ``changes`` collects one line per change made (the helpers add
    theirs), recorded on the cluster and shown by ``zattera cluster status``."""

    conn: Connection
    config: ClusterConfig
    lease: Lease
    progress: Callable[[str], None] = lambda line: None
    changes: list[str] = field(default_factory=list)
    _view: StateView | None = None

    def check_leading(self) -> None:
        """Raise :class:`MigrationInterrupted` unless this runner still holds the lease."""
        if not self.lease.held:
            raise MigrationInterrupted(f"lease {self.lease.loop} lost ({self.lease.lost_reason}): stopping")

    def changed(self, what: str) -> None:
        self.changes.append(what)
        self.progress(what)

    async def create_stream(self, cfg: StreamConfig) -> bool:
        """Create the stream unless it exists (an existing one is left as it is); True when created."""
        self.check_leading()
        _, created = await create_stream_if_missing(self.conn.js, cfg)
        if created:
            self.changed(f"created stream {cfg.name}")
        return created

    async def create_object_store(self, bucket: str) -> bool:
        """Create the object store unless it exists, with the recorded replica count; True when created."""
        self.check_leading()
        _, created = await create_object_store_if_missing(self.conn.js, bucket, self.config.replicas)
        if created:
            self.changed(f"created object store {bucket}")
        return created

    async def create_key_value(self, cfg: KeyValueConfig) -> bool:
        """Create the KV bucket unless it exists (``cfg.replicas`` is set to the recorded count); True when
        created."""
        self.check_leading()
        if await raw_stream_config(self.conn.nc, f"KV_{cfg.bucket}") is not None:
            return False
        cfg.replicas = self.config.replicas
        cfg.storage = cfg.storage or StorageType.FILE
        await until_placed(lambda: self.conn.js.create_key_value(cfg), f"KV_{cfg.bucket}")
        self.changed(f"created bucket {cfg.bucket}")
        return True

    async def edit_stream(self, name: str, edit: Callable[[dict[str, Any]], None]) -> bool:
        """Change an existing stream: ``edit`` changes its configuration (the server's JSON, every field as
        the server has it) in place; the stream is updated only when something differs. False when the
        stream does not exist (provisioning creates it as this code defines it) or nothing changed."""
        self.check_leading()
        before = await raw_stream_config(self.conn.nc, name)
        if before is None:
            return False
        after = copy.deepcopy(before)
        edit(after)
        differences = [
            f"{key} {before.get(key)!r} -> {after.get(key)!r}"
            for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)
        ]
        if not differences:
            return False
        self.check_leading()
        await update_stream_raw(self.conn.nc, after)
        self.changed(f"stream {name}: {'; '.join(differences)}")
        return True

    async def state(self) -> tuple[StateView, Writer]:
        """The state bucket loaded in a view, and a writer whose every commit is fenced by the lease: a key
        layout or message-meaning change rewrites keys through it (``shared/txn.py``: ``commit_many`` for
        many objects); a commit after the lease is lost is refused whole by the server."""
        if self._view is None:
            self._view = StateView(self.conn, name="migration")
            await self._view.start()
        return self._view, Writer(self.conn, self._view, lease=self.lease)

    async def close(self) -> None:
        if self._view is not None:
            await self._view.stop()
            self._view = None


@dataclass(frozen=True)
class Migration:
    """One schema change. ``summary``: one line for docs/upgrades.md, CHANGELOG.md and the logs; ``release``:
    the Zattera version that first ships it; ``apply``: the change, idempotent."""

    summary: str
    release: str
    apply: Callable[[MigrationContext], Awaitable[None]]


@dataclass(frozen=True)
class Step:
    """A migration with its place in the order (number and name come from its module's name)."""

    listed: Listed
    migration: Migration

    @property
    def number(self) -> int:
        return self.listed.number

    @property
    def label(self) -> str:
        return self.listed.label


__all__ = ["KeyValueConfig", "Migration", "MigrationContext", "Step", "StreamConfig"]
