"""Volume data in a backup: each volume's latest COMPLETE snapshot, as the snapshots object store holds it.

A backup carries, per volume, the snapshot's manifest object and every chunk it names, byte for byte as
stored (compressed, and sealed when the cluster has a snapshot key: a backup never holds volume data in the
clear that the cluster did not). They are content-addressed on the target like every backup object, and a
chunk's SHA-256 and size come from its object-store meta, so a chunk the target already holds is neither
read from the cluster nor sent again. A restore writes them back under the same names; the volume then comes
back from that snapshot (``zattera volumes restore``, or the restore itself when a node is there).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import zstandard
from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.backup.cluster import BucketCopy, kind_of
from shared.backup.manifest import BackupError
from shared.connection import Connection
from shared.objects import ObjectCorrupt, object_info, read_object
from shared.snapshots.crypto import SealError
from shared.snapshots.guards import SNAPSHOT_KEY_ENV, describe_key, key_fingerprint, snapshot_target
from shared.snapshots.store import ObjectMissingError, SnapshotStore
from shared.subjects import SNAPSHOTS_STORE


@dataclass(frozen=True)
class SnapshotObject:
    """One object of the snapshots store a backup carries."""

    name: str
    sha256: str
    size: int
    snapshot_id: str
    volume_id: str


def latest_snapshots(state: BucketCopy) -> dict[str, pb.VolumeSnapshot]:
    """Volume id → its newest COMPLETE snapshot record (volumes with none are absent)."""
    volumes = {key.partition(".")[2] for key in state.values if kind_of(key) == K.VOLUME}
    latest: dict[str, pb.VolumeSnapshot] = {}
    for key, data in state.values.items():
        if kind_of(key) != K.SNAPSHOT:
            continue
        snap = pb.VolumeSnapshot.FromString(data)
        if snap.status != pb.SNAPSHOT_STATUS_COMPLETE or snap.volume_id not in volumes:
            continue
        held = latest.get(snap.volume_id)
        when = (snap.meta.created_at.seconds, snap.meta.created_at.nanos, snap.meta.id)
        if held is None or when > (held.meta.created_at.seconds, held.meta.created_at.nanos, held.meta.id):
            latest[snap.volume_id] = snap
    return latest


def chunk_hashes(manifest: bytes) -> list[str]:
    """The chunk hashes a snapshot manifest names, in order (its JSON, docs/wire-contract.md)."""
    return [str(c["hash"]) for c in json.loads(manifest).get("chunks") or []]


def _hex_digest(digest: str | None) -> str:
    """The object store's ``SHA-256=<base64url>`` digest as hex ("" when absent or of another algorithm)."""
    if not digest or not digest.startswith("SHA-256="):
        return ""
    return base64.urlsafe_b64decode(digest.removeprefix("SHA-256=")).hex()


async def _ref(conn: Connection, name: str, snap: pb.VolumeSnapshot) -> SnapshotObject:
    info = await object_info(conn.js, SNAPSHOTS_STORE, name)
    digest = _hex_digest(info.digest) if info is not None else ""
    if info is None or not digest:
        raise BackupError(
            f"volume {snap.volume_id}: snapshot {snap.meta.id}'s object {name} is missing from {SNAPSHOTS_STORE}"
        )
    return SnapshotObject(name, digest, int(info.size or 0), snap.meta.id, snap.volume_id)


async def snapshot_objects(conn: Connection, state: BucketCopy) -> list[SnapshotObject]:
    """The manifest and chunks of each volume's latest COMPLETE snapshot (a chunk shared by two snapshots
    once). :class:`BackupError` names the volume when its snapshot cannot be read (missing object, or sealed
    with another key than this process's ``ZATTERA_SNAPSHOT_KEY``): a backup is never silently without a
    volume's data."""
    latest = latest_snapshots(state)
    if not latest:
        return []
    target = snapshot_target()
    try:
        store = await SnapshotStore.open(conn.js, target)
    except NotFoundError:
        raise BackupError(
            f"the {SNAPSHOTS_STORE} object store is missing but {len(latest)} snapshots name it"
        ) from None
    found: dict[str, SnapshotObject] = {}
    for _, snap in sorted(latest.items()):
        for ref in await objects_of(conn, store, target, snap, known=found):
            found.setdefault(ref.name, ref)
    return list(found.values())


async def objects_of(
    conn: Connection,
    store: SnapshotStore,
    target: cpb.SnapshotTarget,
    snap: pb.VolumeSnapshot,
    *,
    known: dict[str, SnapshotObject] | None = None,
) -> list[SnapshotObject]:
    """The manifest and chunks of one COMPLETE snapshot in ``store`` opened on ``target`` (the manifest first;
    ``known``: objects already looked up, not looked up again). :class:`BackupError` names the volume when the
    snapshot is sealed with another key than ``target``'s, or an object is missing or unreadable."""
    volume_id = snap.volume_id
    ours = key_fingerprint(target)
    if snap.key_fingerprint != ours:
        raise BackupError(
            f"volume {volume_id}: snapshot {snap.meta.id} is sealed with {describe_key(snap.key_fingerprint)} but "
            f"this process has {describe_key(ours)}: set {SNAPSHOT_KEY_ENV} as the cluster's"
        )
    name = store.manifest_name(snap.manifest_key or snap.meta.id)
    try:
        hashes = chunk_hashes(await store.get_decoded(name))
    except (ObjectMissingError, SealError, zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"volume {volume_id}: snapshot {snap.meta.id}'s manifest cannot be read ({exc})") from None
    known = known if known is not None else {}
    refs = [known.get(name) or await _ref(conn, name, snap)]
    for digest in dict.fromkeys(hashes):
        chunk_name = store.chunk_name(digest)
        refs.append(known.get(chunk_name) or await _ref(conn, chunk_name, snap))
    return refs


async def read_snapshot_object(conn: Connection, ref: SnapshotObject) -> bytes:
    """The object's stored bytes, checked against the digest its entry records."""
    try:
        data = await read_object(conn.js, SNAPSHOTS_STORE, ref.name)
    except ObjectCorrupt as exc:
        raise BackupError(f"volume {ref.volume_id}: {exc}") from None
    if data is None or len(data) != ref.size:
        raise BackupError(f"volume {ref.volume_id}: {SNAPSHOTS_STORE}/{ref.name} changed while the backup ran")
    return data


async def write_snapshot_object(conn: Connection, name: str, data: bytes) -> None:
    """Put an object into this cluster's snapshots store under its name (one NATS message when the payload
    limit allows, as the agents write them); one already there is left as it is (content-addressed)."""
    store = await SnapshotStore.open(conn.js)
    if not await store.exists(name):
        await store.put(name, data)


def new_homes(volumes: list[pb.Volume], nodes: list[pb.Node]) -> dict[str, str]:
    """Volume id → the node of this cluster it is restored onto: an env's volumes share one node (a stateful
    service mounts them all), each env on the ALIVE schedulable worker holding the fewest restored volumes so
    far, lowest id on ties. Empty when no node can take one (the volumes stay unpinned)."""
    eligible = sorted(
        n.meta.id
        for n in nodes
        if n.status == pb.NODE_STATUS_ALIVE and n.schedulable and pb.NODE_ROLE_WORKER in n.roles
    )
    if not eligible:
        return {}
    count = dict.fromkeys(eligible, 0)
    env_home: dict[tuple[str, str], str] = {}
    homes: dict[str, str] = {}
    for volume in sorted(volumes, key=lambda v: (v.project_id, v.environment_id, v.name, v.meta.id)):
        env = (volume.project_id, volume.environment_id)
        if env not in env_home:
            env_home[env] = min(eligible, key=lambda n: (count[n], n))
        home = env_home[env]
        count[home] += 1
        homes[volume.meta.id] = home
    return homes
