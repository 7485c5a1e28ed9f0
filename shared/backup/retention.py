"""Retention of the backups on a target: the newest ``keep`` *verified* backups stay, older ones go.

A backup is verified once every object of it was read back and matched its manifest (:func:`mark_verified`
writes ``backups/<id>/verified``). Only verified backups count toward ``keep``: a failed or unverified backup
never pushes a good one out, and with fewer than ``keep`` verified backups nothing is deleted. Objects no
remaining manifest names are deleted once older than ``orphan_grace`` (a backup being written puts its objects
before its manifest, so a young unnamed object may belong to it). The calls are blocking: run them in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.backup.manifest import BackupError, blob_name, manifest_name, parse_manifest
from shared.backup.targets import Target

ORPHAN_GRACE = 24 * 3600.0
"""Seconds an object no manifest names is kept (a backup in progress writes its manifest last)."""


def verified_name(backup_id: str) -> str:
    return f"backups/{backup_id}/verified"


def mark_verified(target: Target, backup_id: str) -> None:
    target.put(verified_name(backup_id), b"ok\n")


def backup_ids(target: Target) -> list[str]:
    """Every backup with a manifest, oldest first (ids are ULIDs)."""
    ids = []
    for name in target.list("backups/"):
        parts = name.split("/")
        if len(parts) == 3 and parts[2] == "manifest.json":
            ids.append(parts[1])
    return sorted(ids)


def doomed(ids: list[str], verified: set[str], keep: int) -> list[str]:
    """The backups retention deletes: every one older than the ``keep``-th newest verified one (none while
    fewer than ``keep`` are verified)."""
    good = [i for i in ids if i in verified]
    if keep < 1 or len(good) <= keep:
        return []
    oldest_kept = good[-keep]
    return [i for i in ids if i < oldest_kept]


@dataclass(frozen=True)
class Pruned:
    kept: int
    """Verified backups on the target after pruning."""
    deleted: list[str]
    objects_deleted: int


def prune(target: Target, keep: int, now: float, *, orphan_grace: float = ORPHAN_GRACE) -> Pruned:
    """Delete what :func:`doomed` names (each manifest first, so a half-deleted backup is no backup), then
    the objects no remaining manifest names and older than ``orphan_grace``."""
    ids = backup_ids(target)
    verified = {i for i in ids if target.exists(verified_name(i))}
    gone = doomed(ids, verified, keep)
    for backup_id in gone:
        target.delete(manifest_name(backup_id))
        target.delete(verified_name(backup_id))
    named: set[str] = set()
    for backup_id in ids:
        if backup_id in gone:
            continue
        data = target.get(manifest_name(backup_id))
        if data is None:
            continue
        try:
            named.update(blob_name(e.sha256) for e in parse_manifest(backup_id, data).entries)
        except BackupError:
            return Pruned(len(verified) - len(set(gone) & verified), gone, 0)  # unreadable: keep every object
    objects = 0
    for name in target.list("blobs/"):
        if name in named:
            continue
        written = target.modified(name)
        if written is not None and written <= now - orphan_grace:
            target.delete(name)
            objects += 1
    return Pruned(len(verified) - len(set(gone) & verified), gone, objects)
