"""Backup and restore of a whole cluster (docs/backup.md): ``create_backup``, ``list_backups``,
``verify_backup``, ``restore_backup``.

A backup is written objects first (by content, each sent only when the target lacks it), its manifest last:
a backup exists once its manifest does, so one that failed half-way is no backup and never replaces an
older one. Listing and verifying need only the target (a fresh machine can check a backup before it has a
cluster); restoring checks every object and opens the secrets key before it writes anything.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared import localca
from shared.actions.context import ActionContext
from shared.actions.refusals import Conflicting, Invalid, NotFound, Unavailable
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
    check_restorable,
    manifest_name,
    parse_manifest,
    sha256,
)
from shared.backup.retention import backup_ids
from shared.backup.targets import Target, open_target
from shared.connection import Connection
from shared.console_users import USERS_BUCKET
from shared.errors import ZatteraError
from shared.events import ERROR, make_event
from shared.ids import new_id
from shared.migrations.registry import SCHEMA
from shared.provisioning import recorded_config
from shared.secrets import KeyMaterialError, Keyring, load_keyring, save_keyring
from shared.subjects import IMAGES_STORE, SOURCES_STORE, STATE_BUCKET
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
    credentials: dict[str, str] = field(default_factory=dict, repr=False)
    """The target's settings (``AWS_ACCESS_KEY_ID``…) when not from the environment (scheduled backups)."""
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
    credentials: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Verified:
    id: str
    objects: int
    bytes: int


@dataclass(frozen=True)
class RestoreBackup:
    target: str
    passphrase: str = field(repr=False)
    keyring_path: str
    """Where the restored cluster secrets key goes (the secrets service's keyring file)."""
    backup_id: str = ""
    force: bool = False
    """Restore into a cluster that already holds projects, apps or envs (what the backup holds is replaced)."""
    local_ca_dir: str = ""
    """Where the backup's local CA goes (the certs service's local CA directory); "": left out."""


@dataclass(frozen=True)
class Restored:
    id: str
    keys: int
    objects: int
    console_users: int
    skipped: list[str]
    """What a restore left out, and why (the old machines' keys; a bucket this cluster lacks; a volume whose
    data could not be brought back, with the command that does it)."""
    volumes: list[str] = field(default_factory=list)
    """The volumes whose data was restored from the snapshot the backup carried."""
    local_ca: str = ""
    """The SHA-256 fingerprint of the local CA certificate the restore put back ("" when none)."""


# ------------------------------------------------------------------ create


def _target(url: str, credentials: dict[str, str] | None = None) -> Target:
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
        await ctx.events.publish(
            make_event(
                "backup.failed",
                f"backup to {request.target} failed: {exc}",
                severity=ERROR,
                fields={"actor": ctx.actor, "target": request.target},
            )
        )
        raise
    await ctx.events.publish(
        make_event(
            "backup.created",
            f"backup {created.id} to {created.target}: {created.objects} objects, {created.bytes} bytes "
            f"({created.sent_bytes} sent)",
            fields={"actor": ctx.actor, "target": created.target, "backup": created.id},
        )
    )
    return created


ZSTD = "zstd"
"""The state object is stored zstd-compressed (``"encoding": "zstd"`` in its entry's meta; backups taken
before are plain JSON): an unchanged cluster's second backup resends it, so it is kept small."""


def _compressed(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=9).compress(data)


def _decoded(manifest: Manifest, kind: str, data: bytes) -> bytes:
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
    target = _target(request.target, request.credentials)
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


def _read_manifest(target: Target, backup_id: str) -> Manifest:
    data = target.get(manifest_name(backup_id))
    if data is None:
        raise NotFound(f"no backup {backup_id} at {target.url}", field="backup_id")
    return parse_manifest(backup_id, data)


def _latest(target: Target, backup_id: str) -> str:
    if backup_id:
        return backup_id
    ids = backup_ids(target)
    if not ids:
        raise NotFound(f"no backup at {target.url}", field="target")
    return ids[-1]


async def list_backups(request: ListBackups) -> list[BackupSummary]:
    """Every backup on the target, oldest first (a manifest that cannot be read is listed with its problem)."""
    target = _target(request.target)

    def read() -> list[BackupSummary]:
        found = []
        for backup_id in backup_ids(target):
            try:
                m = _read_manifest(target, backup_id)
            except BackupError as exc:
                found.append(BackupSummary(backup_id, 0.0, "", 0, 0, 0, 0, problem=str(exc)))
                continue
            found.append(BackupSummary(m.id, m.created_at, m.version, m.schema, m.revision, len(m.entries), m.size))
        return found

    return await asyncio.to_thread(read)


def _check_all(target: Target, manifest: Manifest) -> dict[str, bytes]:
    """Every object of the backup by digest, each checked; :class:`Corrupt` naming every bad one. The
    volumes' data is checked but not kept (it may be far larger than memory): a restore reads each of those
    objects again as it writes it (:func:`_snapshot_blob`)."""
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


def _snapshot_blob(target: Target, manifest: Manifest, entry: Entry) -> bytes:
    """A volume data object read again as a restore writes it, checked again (it was checked before
    anything was written; :class:`Corrupt` if it changed on the target since)."""
    return check_object(manifest.id, entry, target.get(blob_name(entry.sha256)))


async def verify_backup(request: VerifyBackup) -> Verified:
    """Read every object of a backup and check it against the manifest; :class:`Corrupt` names what is
    missing, truncated or altered."""
    target = _target(request.target, request.credentials)

    def check() -> Verified:
        manifest = _read_manifest(target, _latest(target, request.backup_id))
        _check_all(target, manifest)
        return Verified(manifest.id, len(manifest.entries), manifest.size)

    return await asyncio.to_thread(check)


# ------------------------------------------------------------------ restore


def _merge_keyring(path: Path, restored: Keyring) -> None:
    """The restored keys first (the backup's current key is the cluster's again), then the keys the file
    held (what the fresh cluster sealed before the restore stays readable)."""
    try:
        existing = load_keyring(path)
    except KeyMaterialError:
        existing = None
    keys = list(restored.keys)
    known = {bytes(k) for k in keys}
    keys.extend(k for k in (existing.keys if existing else []) if bytes(k) not in known)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    save_keyring(path, Keyring(keys))


KEY_PUBLISHED_WAIT = 60.0
"""Seconds a restore waits for this cluster's secrets service to publish its key (a cluster just started)."""


async def _settled(ctx: ActionContext) -> cluster.BucketCopy:
    """This cluster's state once its secrets service has published its key: a restore never races the
    service's start (which, finding the restored key published and not its own, would refuse to serve)."""
    deadline = ctx.clock.now() + KEY_PUBLISHED_WAIT
    while True:
        here = await cluster.read_state(ctx.conn)
        if cluster.PUBLISHED_KEY in here.values:
            return here
        if ctx.clock.now() >= deadline:
            raise Unavailable(
                f"this cluster's secrets service published no key within {KEY_PUBLISHED_WAIT:.0f}s: is its "
                "control plane running (`zattera up`)? Nothing was restored"
            )
        await ctx.clock.sleep(0.5)


async def restore_backup(ctx: ActionContext, request: RestoreBackup) -> Restored:
    """Put a backup's contents into this cluster. Refused, with nothing written, when an object is bad, the
    passphrase wrong, the backup newer than this code, the cluster not empty (unless forced) or its secrets
    service not started."""
    target = _target(request.target)

    def fetch() -> tuple[Manifest, dict[str, bytes]]:
        manifest = _read_manifest(target, _latest(target, request.backup_id))
        check_restorable(manifest, SCHEMA)
        return manifest, _check_all(target, manifest)

    manifest, blobs = await asyncio.to_thread(fetch)

    def blob(kind: str) -> bytes:
        entry = manifest.entry(kind)
        if entry is None:
            raise Corrupt(f"backup {manifest.id}: the manifest lists no {kind} object")
        return blobs[entry.sha256]

    key_doc = await asyncio.to_thread(recovery.unseal, blob(SECRETS_KEY), request.passphrase)
    try:
        sealed_doc = json.loads(key_doc)
        restored_keys = Keyring([PrivateKey(bytes.fromhex(h)) for h in sealed_doc["keys"]])
    except (ValueError, KeyError, TypeError):
        raise Corrupt(f"backup {manifest.id}: the secrets key object holds no keyring") from None
    ca_material = _local_ca(manifest, sealed_doc)
    state = cluster.BucketCopy.from_json(_decoded(manifest, STATE, blob(STATE)))
    users = cluster.BucketCopy.from_json(blob(CONSOLE_USERS))
    here = await _settled(ctx)
    if not cluster.is_empty(here) and not request.force:
        held = sorted({cluster.kind_of(k) for k in here.values if cluster.kind_of(k) in cluster.OWN_KINDS})
        raise Conflicting(
            f"the cluster is not empty (it holds {', '.join(held)} records): restore into a fresh cluster, "
            "or --force to replace what the backup holds",
            field="force",
        )
    _merge_keyring(Path(request.keyring_path), restored_keys)
    skipped: list[str] = []
    ca_fingerprint = _install_local_ca(request, ca_material, skipped)
    objects = 0
    for kind, store in STORES.items():
        for entry in manifest.of_kind(kind):
            headers = {str(k): str(v) for k, v in dict(entry.meta.get("headers") or {}).items()}
            obj = cluster.StoredObject(entry.name, blobs[entry.sha256], str(entry.meta.get("description", "")), headers)
            await cluster.write_object(ctx.conn, store, obj)
            objects += 1
    carried = {str(e.meta.get("snapshot", "")): str(e.meta.get("volume", "")) for e in manifest.of_kind(SNAPSHOTS)}
    restored_users = 0
    if users.values:
        if await cluster.users_bucket_ready(ctx.conn):
            await cluster.write_bucket(ctx.conn, USERS_BUCKET, sorted(users.values.items()))
            restored_users = len(users.values)
        else:
            skipped.append(f"{len(users.values)} console users: this cluster has no console users bucket")
    old_volumes = [pb.Volume.FromString(d) for k, d in state.values.items() if cluster.kind_of(k) == K.VOLUME]
    homes = volumes.new_homes(old_volumes, ctx.view.nodes())
    values = cluster.restorable(state, carried=frozenset(carried), homes=homes)
    left = sum(1 for k in state.values if cluster.kind_of(k) in cluster.LEFT_BEHIND)
    if left:
        skipped.append(f"{left} keys of the old machines (nodes, assignments, observations, leases)")
    dropped = sum(1 for k in state.values if cluster.kind_of(k) == K.SNAPSHOT) - len(carried)
    if dropped > 0:
        skipped.append(f"{dropped} older snapshot records (a backup carries each volume's latest snapshot only)")
    restoring = {vid: sid for sid, vid in carried.items() if vid in homes}
    for volume in old_volumes:
        if volume.meta.id not in homes:
            skipped.append(f"volume {volume.name} ({volume.meta.id}): no schedulable node to restore it onto")
        elif volume.meta.id not in restoring:
            skipped.append(f"volume {volume.name} ({volume.meta.id}): the backup holds no snapshot of it (empty)")
    data_restored: list[str] = []
    # Environments whose volumes come back wait for their data; every other one is written first, so that
    # stateless envs serve while the volumes' data is still being copied (the RTO of what holds no data).
    waiting = {v.environment_id for v in old_volumes if v.meta.id in restoring}
    late = {K.env(e) for e in waiting} | {K.snapshot(sid) for sid, vid in carried.items() if vid in restoring}
    snapshot_objects = manifest.of_kind(SNAPSHOTS)
    objects += len(snapshot_objects)

    async def volume_data() -> None:
        await _write_snapshot_objects(ctx, target, manifest, snapshot_objects)
        await cluster.write_bucket(
            ctx.conn, STATE_BUCKET, [kv for kv in values if kv[0] in late and cluster.kind_of(kv[0]) == K.SNAPSHOT]
        )
        for volume_id, snapshot_id in sorted(restoring.items()):
            problem = await _restore_volume(ctx, volume_id, snapshot_id)
            if problem:
                skipped.append(
                    f"volume {volume_id}: its data was not restored ({problem}); stop its env and run "
                    f"`zattera volumes restore {volume_id} {snapshot_id}`"
                )
            else:
                data_restored.append(volume_id)

    await cluster.write_state(ctx.conn, [kv for kv in values if kv[0] not in late])
    await volume_data()
    await cluster.write_bucket(
        ctx.conn, STATE_BUCKET, [kv for kv in values if kv[0] in late and cluster.kind_of(kv[0]) == K.ENV]
    )
    await ctx.events.publish(
        make_event(
            "backup.restored",
            f"backup {manifest.id} restored from {target.url}: {len(values)} keys, {objects} objects, "
            f"{len(data_restored)} volumes' data{', the local CA' if ca_fingerprint else ''}",
            fields={"actor": ctx.actor, "target": target.url, "backup": manifest.id},
        )
    )
    return Restored(manifest.id, len(values), objects, restored_users, skipped, data_restored, ca_fingerprint)


def _local_ca(manifest: Manifest, sealed_doc: dict[str, Any]) -> bytes | None:
    """The local CA the sealed document carries, checked (None: a backup taken without one)."""
    material = sealed_doc.get("local_ca")
    if material is None:
        return None
    try:
        data = str(material).encode()
        localca.parse(data)
    except localca.BadLocalCA:
        raise Corrupt(f"backup {manifest.id}: the secrets key object holds a local CA that is not one") from None
    return data


def _install_local_ca(request: RestoreBackup, material: bytes | None, skipped: list[str]) -> str:
    """Put the backup's local CA in the certs service's directory (it issues from it at its next order); its
    fingerprint, or "" with why in ``skipped``."""
    if material is None:
        skipped.append("the local CA: the backup holds none (taken before backups carried it); this machine's stays")
        return ""
    if not request.local_ca_dir:
        skipped.append("the local CA: no local CA directory to restore it into (--data-dir)")
        return ""
    return localca.fingerprint(localca.install(Path(request.local_ca_dir), material))


SNAPSHOT_COPIES = 8
"""Volume data objects copied from the target into the snapshots store at once."""


async def _write_snapshot_objects(ctx: ActionContext, target: Target, manifest: Manifest, entries: list[Entry]) -> None:
    """The volumes' data objects into this cluster's snapshots store, checked again as they are read,
    :data:`SNAPSHOT_COPIES` at a time."""
    limit = asyncio.Semaphore(SNAPSHOT_COPIES)

    async def copy(entry: Entry) -> None:
        async with limit:
            data = await asyncio.to_thread(_snapshot_blob, target, manifest, entry)
            await volumes.write_snapshot_object(ctx.conn, entry.name, data)

    await asyncio.gather(*(copy(entry) for entry in entries))


VOLUME_RESTORE_WAIT = 30.0
"""Seconds a restore waits for this cluster's view to show a restored volume and its snapshot record."""


async def _restore_volume(ctx: ActionContext, volume_id: str, snapshot_id: str) -> str:
    """Rebuild a restored volume on its new node from the snapshot the backup carried, before its env
    exists (so nothing mounts it meanwhile); "" when done, else why not."""
    from shared.snapshots.dispatch import operator_dispatcher

    deadline = ctx.clock.now() + VOLUME_RESTORE_WAIT
    while ctx.view.volume(volume_id) is None or ctx.view.snapshot(snapshot_id) is None:
        if ctx.clock.now() >= deadline:
            return f"its records did not reach this process's view within {VOLUME_RESTORE_WAIT:.0f}s"
        await ctx.clock.sleep(0.1)
    dispatcher = ctx.snapshots or operator_dispatcher(ctx.conn, ctx.view, ctx.clock)
    try:
        await dispatcher.restore(volume_id, snapshot_id, ctx.writer)
    except ZatteraError as exc:
        return str(exc)
    return ""
