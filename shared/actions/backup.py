"""Taking and reading whole-cluster backups (docs/backup.md): ``create_backup``, ``list_backups``,
``verify_backup``, and the reading and checking of a backup's manifest and objects that restoring
(:mod:`shared.actions.backup_restore`) shares.

A backup is written objects first (by content, each sent only when the target lacks it), its manifest last:
a backup exists once its manifest does, so one that failed half-way is no backup and never replaces an
older one. Listing and verifying need only the target (a fresh machine can check a backup before it has a
cluster).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from shared import localca
from shared.actions.context import ActionContext
from shared.actions.fields import OneOffSettings
from shared.actions.refusals import Invalid, NotFound
from shared.backup import cluster, recovery, volumes
from shared.backup.manifest import (
    CONSOLE_USERS,
    IMAGES,
    SECRETS_KEY,
    SNAPSHOTS,
    SOURCES,
    STATE,
    BackupError,
    Corrupt,
    Entry,
    Manifest,
    blob_name,
    check_object,
    manifest_name,
    parse_manifest,
    sha256,
)
from shared.backup.retention import backup_ids
from shared.backup.targets import Target, open_target
from shared.connection import Connection
from shared.events import ERROR
from shared.ids import new_id
from shared.migrations.registry import SCHEMA
from shared.provisioning import recorded_config
from shared.secrets import KeyMaterialError, Keyring, load_keyring
from shared.subjects import IMAGES_STORE, SOURCES_STORE
from shared.version import VERSION

log = logging.getLogger(__name__)

STORES = {SOURCES: SOURCES_STORE, IMAGES: IMAGES_STORE}
"""Object kinds of a backup → the object store each comes from."""


@dataclass(frozen=True)
class CreateBackup:
    target: str
    passphrase: str = field(repr=False)
    """The recovery passphrase the cluster secrets key is sealed to ("" when :attr:`recipient` is given)."""
    keyring_path: str
    """The secrets service's keyring file (``<data>/control/secrets/cluster.key`` under ``zattera up``); "" when
    :attr:`keyring` is given."""
    recipient: str = ""
    """A recovery recipient (:func:`shared.backup.recovery.recipient`, its JSON): the key is sealed to it, no
    passphrase needed."""
    credentials: OneOffSettings = field(default_factory=dict, repr=False)
    """When not from the environment (scheduled backups)."""
    local_ca_dir: str = ""
    """The certs service's local CA directory (``<data>/control/certs``): the CA goes into the backup, sealed
    with the keyring; "" (or no CA there): a backup without it."""


@dataclass(frozen=True)
class BackupCreated:
    id: str
    target: str
    revision: int
    objects: int
    bytes: int
    sent_bytes: int
    """What went over the wire: objects the target already held are not sent again."""


@dataclass(frozen=True)
class ListBackups:
    target: str


@dataclass(frozen=True)
class BackupSummary:
    id: str
    created_at: float
    version: str
    schema: int
    revision: int
    objects: int
    bytes: int
    problem: str = ""
    """Why the manifest cannot be read ("" when it can)."""


@dataclass(frozen=True)
class VerifyBackup:
    target: str
    backup_id: str = ""
    """"" = the newest."""
    credentials: OneOffSettings = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Verified:
    id: str
    objects: int
    bytes: int


# ------------------------------------------------------------------ create


def open_backup_target(url: str, credentials: dict[str, str] | None = None) -> Target:
    """The backup target at ``url``; a bad URL is refused as :class:`Invalid` ``target``."""
    try:
        return open_target(url, credentials)
    except BackupError as exc:
        raise Invalid("target", str(exc), said="") from None


def _keyring_bytes(request: CreateBackup, keyring: Keyring | None) -> bytes:
    if keyring is None:
        try:
            keyring = load_keyring(Path(request.keyring_path))
        except KeyMaterialError as exc:
            raise Invalid("keyring_path", str(exc), said="") from None
    if keyring is None:
        raise NotFound(
            f"no cluster secrets key at {request.keyring_path}: run the backup where the control plane's data "
            "directory is (--data-dir)",
            field="keyring_path",
        )
    doc: dict[str, Any] = {"keys": [bytes(k).hex() for k in keyring.keys]}
    material = localca.read_material(Path(request.local_ca_dir)) if request.local_ca_dir else None
    if material is not None:
        try:
            localca.parse(material)
        except localca.BadLocalCA as exc:
            raise Invalid("local_ca_dir", f"{request.local_ca_dir}: {exc}", said="") from None
        doc["local_ca"] = material.decode()
    return json.dumps(doc).encode()


def _seal_keyring(request: CreateBackup, keyring: bytes) -> bytes:
    if request.recipient:
        return recovery.seal_to(keyring, request.recipient.encode())
    return recovery.seal(keyring, request.passphrase)


async def create_backup(ctx: ActionContext, request: CreateBackup, *, keyring: Keyring | None = None) -> BackupCreated:
    """Copy the cluster to ``request.target``; a failure is a ``backup.failed`` event and raises. ``keyring``:
    the cluster secrets key when the caller holds it (the secrets service), else read from ``keyring_path``."""
    try:
        created = await _create(ctx, request, keyring)
    except Exception as exc:
        await ctx.announce(
            "backup.failed", f"backup to {request.target} failed: {exc}", severity=ERROR, target=request.target
        )
        raise
    sent = f"{created.objects} objects, {created.bytes} bytes ({created.sent_bytes} sent)"
    await ctx.announce(
        "backup.created", f"backup {created.id} to {created.target}: {sent}", target=created.target, backup=created.id
    )
    return created


ZSTD = "zstd"
"""The state object is stored zstd-compressed (``"encoding": "zstd"`` in its entry's meta; backups taken
before are plain JSON): an unchanged cluster's second backup resends it, so it is kept small."""


def _compressed(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=9).compress(data)


def decoded(manifest: Manifest, kind: str, data: bytes) -> bytes:
    """The ``kind`` object's bytes as written, decompressed when its entry says it was stored compressed."""
    entry = manifest.entry(kind)
    if entry is None or entry.meta.get("encoding") != ZSTD:
        return data
    try:
        return zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError:
        raise Corrupt(f"backup {manifest.id}: the {kind} object does not decompress") from None


async def _create(ctx: ActionContext, request: CreateBackup, held: Keyring | None) -> BackupCreated:
    if request.recipient:
        recovery.check_recipient(request.recipient.encode())
    else:
        recovery.check_passphrase(request.passphrase)
    keyring = _keyring_bytes(request, held)
    target = open_backup_target(request.target, request.credentials)
    await asyncio.to_thread(target.check)
    config = await recorded_config(ctx.conn.js)
    state = await cluster.read_state(ctx.conn)
    users = await cluster.read_console_users(ctx.conn)
    sealed = await asyncio.to_thread(_seal_keyring, request, keyring)
    pieces: list[tuple[Entry, bytes]] = []

    def add(kind: str, name: str, data: bytes, meta: dict[str, Any] | None = None) -> None:
        pieces.append((Entry(kind, name, sha256(data), len(data), meta or {}), data))

    add(STATE, STATE, _compressed(state.to_json()), {"encoding": ZSTD})
    add(CONSOLE_USERS, CONSOLE_USERS, users.to_json())
    add(SECRETS_KEY, SECRETS_KEY, sealed)
    for kind, store in STORES.items():
        for obj in await cluster.read_store(ctx.conn, store):
            add(kind, obj.name, obj.data, {"description": obj.description, "headers": obj.headers})
    snapshot_refs = await volumes.snapshot_objects(ctx.conn, state)
    snapshot_entries = [
        Entry(SNAPSHOTS, r.name, r.sha256, r.size, {"snapshot": r.snapshot_id, "volume": r.volume_id})
        for r in snapshot_refs
    ]
    manifest = Manifest(
        id=new_id(),
        created_at=ctx.clock.now(),
        version=VERSION,
        schema=config.schema if config else SCHEMA,
        revision=state.revision,
        cluster_id=config.cluster_id if config else "",
        entries=(*(e for e, _ in pieces), *snapshot_entries),
    )

    def send() -> int:
        sent = 0
        for entry, data in pieces:
            if not target.exists(blob_name(entry.sha256)):
                target.put(blob_name(entry.sha256), data)
                sent += len(data)
        return sent

    sent = await asyncio.to_thread(send)
    sent += await _send_snapshot_objects(ctx.conn, target, snapshot_refs)
    body = manifest.to_json()
    await asyncio.to_thread(target.put, manifest_name(manifest.id), body)
    sent += len(body)
    return BackupCreated(manifest.id, target.url, manifest.revision, len(pieces), manifest.size, sent)


async def _send_snapshot_objects(conn: Connection, target: Target, refs: list[volumes.SnapshotObject]) -> int:
    """Send the snapshot objects the target lacks, each read from the cluster only then (an unchanged
    volume's chunks are neither read nor sent again); the bytes sent."""

    def lacking() -> list[volumes.SnapshotObject]:
        seen: set[str] = set()
        out = []
        for ref in refs:
            if ref.sha256 not in seen and not target.exists(blob_name(ref.sha256)):
                out.append(ref)
            seen.add(ref.sha256)
        return out

    sent = 0
    for ref in await asyncio.to_thread(lacking):
        data = await volumes.read_snapshot_object(conn, ref)
        if sha256(data) != ref.sha256:
            raise BackupError(f"volume {ref.volume_id}: {ref.name} changed while the backup ran")
        await asyncio.to_thread(target.put, blob_name(ref.sha256), data)
        sent += len(data)
    return sent


# ------------------------------------------------------------------ read


def read_manifest(target: Target, backup_id: str) -> Manifest:
    """Backup ``backup_id``'s manifest on ``target``, parsed; :class:`NotFound` when there is none."""
    data = target.get(manifest_name(backup_id))
    if data is None:
        raise NotFound(f"no backup {backup_id} at {target.url}", field="backup_id")
    return parse_manifest(backup_id, data)


def latest_id(target: Target, backup_id: str) -> str:
    """``backup_id``, or when "" the newest backup's on ``target``."""
    if backup_id:
        return backup_id
    ids = backup_ids(target)
    if not ids:
        raise NotFound(f"no backup at {target.url}", field="target")
    return ids[-1]


async def list_backups(request: ListBackups) -> list[BackupSummary]:
    """Every backup on the target, oldest first (a manifest that cannot be read is listed with its problem)."""
    target = open_backup_target(request.target)

    def read() -> list[BackupSummary]:
        found = []
        for backup_id in backup_ids(target):
            try:
                m = read_manifest(target, backup_id)
            except BackupError as exc:
                found.append(BackupSummary(backup_id, 0.0, "", 0, 0, 0, 0, problem=str(exc)))
                continue
            found.append(BackupSummary(m.id, m.created_at, m.version, m.schema, m.revision, len(m.entries), m.size))
        return found

    return await asyncio.to_thread(read)


def check_all(target: Target, manifest: Manifest) -> dict[str, bytes]:
    """Every object of the backup by digest, each checked; :class:`Corrupt` naming every bad one. The
    volumes' data is checked but not kept (it may be far larger than memory): a restore reads each of those
    objects again as it writes it (:func:`snapshot_blob`)."""
    good: dict[str, bytes] = {}
    checked: set[str] = set()
    problems: list[str] = []
    for entry in manifest.entries:
        if entry.sha256 in checked:
            continue
        try:
            data = check_object(manifest.id, entry, target.get(blob_name(entry.sha256)))
        except Corrupt as exc:
            problems.append(str(exc).removeprefix(f"backup {manifest.id}: "))
            continue
        checked.add(entry.sha256)
        if entry.kind != SNAPSHOTS:
            good[entry.sha256] = data
    if problems:
        raise Corrupt(f"backup {manifest.id}: " + "; ".join(problems))
    return good


def snapshot_blob(target: Target, manifest: Manifest, entry: Entry) -> bytes:
    """A volume data object read again as a restore writes it, checked again (it was checked before
    anything was written; :class:`Corrupt` if it changed on the target since)."""
    return check_object(manifest.id, entry, target.get(blob_name(entry.sha256)))


async def verify_backup(request: VerifyBackup) -> Verified:
    """Read every object of a backup and check it against the manifest; :class:`Corrupt` names what is
    missing, truncated or altered."""
    target = open_backup_target(request.target, request.credentials)

    def check() -> Verified:
        manifest = read_manifest(target, latest_id(target, request.backup_id))
        check_all(target, manifest)
        return Verified(manifest.id, len(manifest.entries), manifest.size)

    return await asyncio.to_thread(check)
