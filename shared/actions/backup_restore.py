"""Restoring a whole-cluster backup into this cluster (docs/backup.md): ``restore_backup``.

Every object is checked and the secrets key opened before anything is written; the cluster must be empty
(unless forced) and its secrets service started. Environments whose volumes come back are written last,
once their data is restored from the snapshots the backup carried.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared import localca
from shared.actions.backup import (
    STORES,
    check_all,
    decoded,
    latest_id,
    open_backup_target,
    read_manifest,
    snapshot_blob,
)
from shared.actions.context import ActionContext
from shared.actions.refusals import Conflicting, Unavailable
from shared.backup import cluster, recovery, volumes
from shared.backup.manifest import (
    CONSOLE_USERS,
    SECRETS_KEY,
    SNAPSHOTS,
    STATE,
    Corrupt,
    Entry,
    Manifest,
    check_restorable,
)
from shared.backup.targets import Target
from shared.console_users import USERS_BUCKET
from shared.errors import ZatteraError
from shared.migrations.registry import SCHEMA
from shared.secrets import KeyMaterialError, Keyring, load_keyring, save_keyring
from shared.subjects import STATE_BUCKET


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
    target = open_backup_target(request.target)

    def fetch() -> tuple[Manifest, dict[str, bytes]]:
        manifest = read_manifest(target, latest_id(target, request.backup_id))
        check_restorable(manifest, SCHEMA)
        return manifest, check_all(target, manifest)

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
    state = cluster.BucketCopy.from_json(decoded(manifest, STATE, blob(STATE)))
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
    what = f"{len(values)} keys, {objects} objects, {len(data_restored)} volumes' data"
    what += ", the local CA" if ca_fingerprint else ""
    message = f"backup {manifest.id} restored from {target.url}: {what}"
    await ctx.announce("backup.restored", message, target=target.url, backup=manifest.id)
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
            data = await asyncio.to_thread(snapshot_blob, target, manifest, entry)
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
