"""Retention of volume snapshots on an off-site target: a volume keeps there the newest snapshots its policy
keeps locally (``keep_last``), and older ones go.

A doomed snapshot's index goes first (a snapshot is on the target while its index is, so a half-deleted one
is no snapshot), then its manifest. Chunks are shared by every snapshot sealed alike, of any volume: one is
deleted once no remaining index on the target names it and it is ``orphan_grace`` old (a copy in progress
writes its chunks before its index). An index that cannot be read keeps every object. Only the volumes named
are pruned; the indexes of any other volume on the target are read, never deleted. The calls block: run them
in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.backup.manifest import Corrupt
from shared.backup.offsite import INDEX, ROOT, index_name, offsite_ids, parse_index
from shared.backup.retention import ORPHAN_GRACE
from shared.backup.targets import Target


@dataclass(frozen=True)
class OffsitePruned:
    deleted: dict[str, list[str]] = field(default_factory=dict)
    """Volume id → the ids of its snapshots deleted from the target, oldest first."""
    objects_deleted: int = 0
    """Manifests and chunks deleted."""
    kept_objects: str = ""
    """Why no chunk was deleted (an index that cannot be read), "" otherwise."""


def doomed_snapshots(ids: list[str], keep: int) -> list[str]:
    """The snapshots older than the ``keep`` newest (``ids`` sorted: snapshot ids are ULIDs, oldest first)."""
    return ids[:-keep] if keep >= 1 and len(ids) > keep else []


def prune_offsite(
    target: Target, keep_of: Mapping[str, int], now: float, *, orphan_grace: float = ORPHAN_GRACE
) -> OffsitePruned:
    """Delete each named volume's snapshots beyond its ``keep_of`` count from ``target``, then the objects no
    remaining index names (a doomed snapshot's manifest at once, a chunk once ``orphan_grace`` old)."""
    deleted: dict[str, list[str]] = {}
    manifests: set[str] = set()
    for volume_id, keep in sorted(keep_of.items()):
        gone = doomed_snapshots(offsite_ids(target, volume_id), keep)
        for snapshot_id in gone:
            name = index_name(volume_id, snapshot_id)
            data = target.get(name)
            target.delete(name)
            if data is not None:
                try:
                    manifests.update(e.kind for e in parse_index(name, data).objects if "/manifests/" in e.kind)
                except Corrupt:
                    pass  # its objects are left to the grace rule below
        if gone:
            deleted[volume_id] = gone
    named: set[str] = set()
    for name in target.list(INDEX):
        data = target.get(name) if name.endswith(".json") else None
        if data is None:
            continue
        try:
            named.update(e.kind for e in parse_index(name, data).objects)
        except Corrupt as exc:
            return OffsitePruned(deleted, 0, f"{exc}: no object deleted")
    objects = 0
    for name in target.list(ROOT):
        if name.startswith(INDEX) or name in named:
            continue
        if name not in manifests:
            written = target.modified(name)
            if written is None or written > now - orphan_grace:
                continue
        target.delete(name)
        objects += 1
    return OffsitePruned(deleted, objects)
