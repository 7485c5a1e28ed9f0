"""Volume snapshots off-site: a COMPLETE snapshot copied to a backup target, and fetched back from it.

On the target (a directory or ``s3://bucket[/prefix]``, :mod:`shared.backup.targets`) a volume's snapshots
are, under ``volumes/``:

* ``<space>/chunks/<sha256>`` and ``<space>/manifests/<snapshot id>``: the objects of ``zattera-snapshots``
  byte for byte as stored (zstd, sealed when the cluster has a ``ZATTERA_SNAPSHOT_KEY``), content addressed
  and shared by every snapshot sealed alike (``<space>`` = the key's fingerprint, or ``unsealed``): a chunk
  the target holds is never sent again;
* ``index/<volume id>/<snapshot id>.json``: written LAST, so a snapshot is on the target once its index is —
  the snapshot's record, the volume it belongs to, and each object's name, SHA-256 and size.

A copy lists the target's chunks once and sends only the ones it lacks (and the manifest), then the index.
A fetch reads the index, checks every object against it (a missing, truncated or altered one is named),
and writes the objects the local store lacks back into ``zattera-snapshots``; ``zattera volumes restore``
then rebuilds the volume from it as from any local snapshot. Target calls block: they run in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass

from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.backup.manifest import BackupError, Corrupt, sha256
from shared.backup.manifest import Entry as ObjectEntry
from shared.backup.targets import Target
from shared.backup.volumes import objects_of, read_snapshot_object, write_snapshot_object
from shared.connection import Connection
from shared.snapshots.store import CHUNKS, SnapshotStore
from shared.subjects import SNAPSHOTS_STORE
from shared.version import VERSION

ROOT = "volumes/"
INDEX = f"{ROOT}index/"
FORMAT = 1


class NotOffsite(BackupError):
    """The target holds no (such) off-site snapshot of the volume."""


def space(fingerprint: str) -> str:
    """Where objects sealed with the key of ``fingerprint`` live on the target (chunks sealed differently
    never share a name)."""
    return f"{ROOT}{fingerprint or 'unsealed'}/"


def index_name(volume_id: str, snapshot_id: str) -> str:
    return f"{INDEX}{volume_id}/{snapshot_id}.json"


@dataclass(frozen=True)
class Copied:
    snapshot_id: str
    volume_id: str
    sent_bytes: int
    sent_objects: int
    objects: int
    """Objects the snapshot is made of (manifest and chunks); those not sent were on the target already."""


@dataclass(frozen=True)
class OffsiteSnapshot:
    """One snapshot's index on a target."""

    record: pb.VolumeSnapshot
    volume_name: str
    objects: tuple[ObjectEntry, ...]
    """Names in ``zattera-snapshots`` (``kind`` = the name on the target)."""
    copied_at: float

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "volume": {"id": self.record.volume_id, "name": self.volume_name},
                "snapshot": {
                    "id": self.record.meta.id,
                    "created_at": self.record.meta.created_at.ToNanoseconds() / 1e9,
                    "logical_size_bytes": self.record.logical_size_bytes,
                    "key_fingerprint": self.record.key_fingerprint,
                    "record": base64.b64encode(self.record.SerializeToString(deterministic=True)).decode(),
                },
                "copied_at": self.copied_at,
                "objects": [{"name": e.name, "at": e.kind, "sha256": e.sha256, "size": e.size} for e in self.objects],
            },
            indent=1,
            sort_keys=True,
        ).encode()


def parse_index(name: str, data: bytes) -> OffsiteSnapshot:
    """The index's contents; :class:`Corrupt` naming it when it is not one, or of a newer format."""
    try:
        doc = json.loads(data)
        if int(doc.get("format", 0)) > FORMAT:
            raise Corrupt(f"{name}: format {doc['format']} is newer than this Zattera reads ({FORMAT})")
        record = pb.VolumeSnapshot.FromString(base64.b64decode(doc["snapshot"]["record"]))
        objects = tuple(
            ObjectEntry(str(o["at"]), str(o["name"]), str(o["sha256"]), int(o["size"])) for o in doc["objects"]
        )
        return OffsiteSnapshot(record, str(doc["volume"]["name"]), objects, float(doc["copied_at"]))
    except Corrupt:
        raise
    except Exception as exc:
        raise Corrupt(f"{name} is not an off-site snapshot index ({type(exc).__name__})") from None


def offsite_ids(target: Target, volume_id: str) -> list[str]:
    """The ids of the volume's snapshots on ``target`` (indexes written), sorted."""
    prefix = f"{INDEX}{volume_id}/"
    return sorted(n[len(prefix) :].removesuffix(".json") for n in target.list(prefix) if n.endswith(".json"))


async def copy_snapshot(
    conn: Connection, store_target: cpb.SnapshotTarget, target: Target, volume: pb.Volume, snap: pb.VolumeSnapshot
) -> Copied:
    """Copy a COMPLETE snapshot to ``target``: the objects it lacks, then the index. :class:`BackupError`
    (a :class:`~shared.backup.targets.TargetError` for the target) names what failed."""
    store = await SnapshotStore.open(conn.js, store_target)
    refs = await objects_of(conn, store, store_target, snap)
    place = space(snap.key_fingerprint)
    await asyncio.to_thread(target.check)
    have = set(await asyncio.to_thread(target.list, f"{place}{CHUNKS}"))
    sent_bytes = sent_objects = 0
    entries: list[ObjectEntry] = []
    for ref in refs:
        at = place + ref.name.removeprefix(store.prefix)
        entries.append(ObjectEntry(at, ref.name, ref.sha256, ref.size))
        if at in have:
            continue
        if not at.startswith(f"{place}{CHUNKS}") and await asyncio.to_thread(target.exists, at):
            continue
        data = await read_snapshot_object(conn, ref)
        await asyncio.to_thread(target.put, at, data)
        sent_bytes += len(data)
        sent_objects += 1
    index = OffsiteSnapshot(snap, volume.name, tuple(entries), time.time())
    body = index.to_json()
    await asyncio.to_thread(target.put, index_name(volume.meta.id, snap.meta.id), body)
    return Copied(snap.meta.id, volume.meta.id, sent_bytes + len(body), sent_objects + 1, len(entries))


def read_index(target: Target, volume_id: str, snapshot_id: str = "") -> OffsiteSnapshot:
    """The index of ``snapshot_id`` (default: the newest) of the volume on ``target``; :class:`NotOffsite`
    when there is none."""
    if not snapshot_id:
        found = [read_index(target, volume_id, s) for s in offsite_ids(target, volume_id)]
        if not found:
            raise NotOffsite(f"{target.url} holds no off-site snapshot of volume {volume_id}")
        return max(found, key=lambda i: (i.record.meta.created_at.ToNanoseconds(), i.record.meta.id))
    name = index_name(volume_id, snapshot_id)
    data = target.get(name)
    if data is None:
        raise NotOffsite(f"{target.url} holds no off-site snapshot {snapshot_id} of volume {volume_id}")
    index = parse_index(name, data)
    if index.record.volume_id != volume_id or index.record.meta.id != snapshot_id:
        raise Corrupt(f"{name} names snapshot {index.record.meta.id} of volume {index.record.volume_id}")
    return index


async def fetch_snapshot(conn: Connection, target: Target, index: OffsiteSnapshot) -> int:
    """Put the snapshot's objects back into ``zattera-snapshots`` (those it lacks), each checked against the
    index first (:class:`Corrupt` names a missing, truncated or altered one); returns the bytes fetched."""
    try:
        store = await SnapshotStore.open(conn.js)
    except NotFoundError:
        raise BackupError(f"the {SNAPSHOTS_STORE} object store is missing (`zattera up` creates it on start)") from None
    label = f"off-site snapshot {index.record.meta.id}"
    fetched = 0
    for entry in index.objects:
        if await store.exists(entry.name):
            continue
        data = await asyncio.to_thread(target.get, entry.kind)
        if data is None:
            raise Corrupt(f"{target.url}: {label}: object {entry.kind} is missing")
        if len(data) != entry.size:
            raise Corrupt(f"{target.url}: {label}: object {entry.kind} is {len(data)} bytes, expected {entry.size}")
        if sha256(data) != entry.sha256:
            raise Corrupt(f"{target.url}: {label}: object {entry.kind} does not match its SHA-256 (altered)")
        await write_snapshot_object(conn, entry.name, data)
        fetched += len(data)
    return fetched
