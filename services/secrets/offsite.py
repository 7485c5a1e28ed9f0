"""OffsiteSnapshots (lease ``snapshot-offsite``): each COMPLETE snapshot of a volume whose policy names an
off-site target is copied there after it is taken (:mod:`shared.backup.offsite`: only the chunks the target
lacks, the index last).

It runs in the secrets service because the target's settings are sealed to the cluster secrets key, which
only this service holds. What is on a target is learnt once per term by listing each volume's indexes there,
then remembered; a snapshot copied is ``volume.offsite_copied``. **A failed copy is loud**: a
``volume.offsite_failed`` event (error) with the cause, retried after 1 minute, doubling up to an hour,
each failure an event again. Causes name the target and the S3 error, never a setting's value.

After the copies, each target is pruned at most once per :data:`PRUNE_INTERVAL`
(:mod:`shared.backup.offsite_retention`): every volume whose policy names it keeps there the newest snapshots
its policy keeps locally; a snapshot deleted is ``volume.offsite_pruned``, a prune that failed
``volume.offsite_prune_failed`` (warning, tried again an interval later). A target whose copies are
failing is not pruned until one works. Only a volume's newest kept snapshots are copied, so what retention
deleted is never sent again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.backoff import exponential
from shared.backup.offsite import copy_snapshot, offsite_ids
from shared.backup.offsite_retention import OffsitePruned, prune_offsite
from shared.backup.sealed import open_settings
from shared.backup.targets import Target, open_target
from shared.events import ERROR, WARNING, env_event
from shared.loop import LeaderLoop, LoopDeps
from shared.secrets import Keyring
from shared.snapshots.guards import snapshot_target
from shared.volumes import snapshots_kept

log = logging.getLogger(__name__)

TICK = 300.0
FIRST_RETRY = 60.0
LAST_RETRY = 3600.0
PRUNE_INTERVAL = 3600.0
"""Seconds between two prunes of one target (each reads every index there and lists its objects)."""


def _created(pair: tuple[pb.Volume, pb.VolumeSnapshot]) -> tuple[int, str]:
    return pair[1].meta.created_at.ToNanoseconds(), pair[1].meta.id


def pending(volumes: list[pb.Volume], snapshots: list[pb.VolumeSnapshot]) -> list[tuple[pb.Volume, pb.VolumeSnapshot]]:
    """The COMPLETE snapshots of each volume whose policy names an off-site target, the newest its policy
    keeps, with their volume, oldest first (pure)."""
    offsite = {v.meta.id: v for v in volumes if v.snapshot_policy.offsite_target}
    found: dict[str, list[tuple[pb.Volume, pb.VolumeSnapshot]]] = {}
    for snap in snapshots:
        if snap.status == pb.SNAPSHOT_STATUS_COMPLETE and snap.volume_id in offsite:
            found.setdefault(snap.volume_id, []).append((offsite[snap.volume_id], snap))
    kept: list[tuple[pb.Volume, pb.VolumeSnapshot]] = []
    for volume_id, own in found.items():
        kept += sorted(own, key=_created)[-snapshots_kept(offsite[volume_id].snapshot_policy) :]
    return sorted(kept, key=_created)


def by_target(volumes: list[pb.Volume]) -> dict[str, list[pb.Volume]]:
    """The volumes whose policy names each off-site target, by id (pure)."""
    targets: dict[str, list[pb.Volume]] = {}
    for volume in sorted(volumes, key=lambda v: v.meta.id):
        if volume.snapshot_policy.offsite_target:
            targets.setdefault(volume.snapshot_policy.offsite_target, []).append(volume)
    return targets


@dataclass
class Failing:
    failures: int
    retry_at: float


class OffsiteSnapshots(LeaderLoop):
    name = "snapshot-offsite"
    kinds = frozenset({K.SNAPSHOT, K.VOLUME})

    def __init__(self, deps: LoopDeps, keyring: Callable[[], Keyring | None], *, tick: float = TICK) -> None:
        super().__init__(deps, tick=tick)
        self.keyring = keyring
        self._pruned_at: dict[str, float] = {}
        """Target (as the policies name it) → when it was last pruned, or a prune of it last failed."""
        self._copied: set[tuple[str, str]] = set()
        """(target URL, snapshot id) known to be on the target."""
        self._listed: set[tuple[str, str]] = set()
        """(target URL, volume id) whose indexes on the target were listed this term."""
        self._failing: dict[tuple[str, str], Failing] = {}

    def on_term_start(self) -> None:
        self._copied.clear()
        self._listed.clear()
        self._failing.clear()
        self._pruned_at.clear()

    def seconds_until_due(self) -> float | None:
        if not self._failing:
            return None
        return max(min(f.retry_at for f in self._failing.values()) - self.clock.now(), 0.0)

    async def run_pass(self) -> None:
        todo = pending(self.view.volumes(), self.view.snapshots())
        wanted = {(v.snapshot_policy.offsite_target, s.meta.id) for v, s in todo}
        for gone in [key for key in self._failing if key not in wanted]:
            del self._failing[gone]  # pruned, or the policy changed: no retry is due for it any more
        for volume, snap in todo:
            policy = volume.snapshot_policy
            key = (policy.offsite_target, snap.meta.id)
            failing = self._failing.get(key)
            if key in self._copied or (failing is not None and failing.retry_at > self.clock.now()):
                continue
            try:
                settings = open_settings(self.keyring(), policy.offsite_sealed_settings, policy.offsite_key_id)
                target = open_target(policy.offsite_target, settings)
                if (target.url, volume.meta.id) not in self._listed:
                    await asyncio.to_thread(target.check)
                    held = await asyncio.to_thread(offsite_ids, target, volume.meta.id)
                    self._copied.update((target.url, s) for s in held)
                    self._listed.add((target.url, volume.meta.id))
                    if key in self._copied:
                        continue
                await self._copy(target, volume, snap)
            except Exception as exc:
                await self._failed(volume, snap, str(exc) or type(exc).__name__)
            else:
                self._failing.pop(key, None)
                self._copied.add(key)
        for url, volumes in by_target(self.view.volumes()).items():
            if any(failing_url == url for failing_url, _ in self._failing):
                continue  # the target fails its copies (each an event already): no prune until one works
            if self.clock.now() - self._pruned_at.get(url, float("-inf")) >= PRUNE_INTERVAL:
                self._pruned_at[url] = self.clock.now()
                await self._prune(url, volumes)

    async def _prune(self, url: str, volumes: list[pb.Volume]) -> None:
        """Prune ``url`` of the snapshots of ``volumes`` (every volume whose policy names it) beyond what each
        keeps; opened with the first one's settings."""
        policy = volumes[0].snapshot_policy
        try:
            settings = open_settings(self.keyring(), policy.offsite_sealed_settings, policy.offsite_key_id)
            target = open_target(url, settings)
            keep_of = {v.meta.id: snapshots_kept(v.snapshot_policy) for v in volumes}
            pruned = await asyncio.to_thread(prune_offsite, target, keep_of, self.clock.now())
        except Exception as exc:
            cause = str(exc) or type(exc).__name__
            log.error("off-site target %s not pruned: %s", url, cause)
            message = f"off-site target {url} not pruned (snapshots of volume {volumes[0].name} and others): {cause}"
            fields = {"volume": volumes[0].meta.id, "target": url}
            event = env_event(
                "volume.offsite_prune_failed", message, volumes[0], clock=self.clock, severity=WARNING, fields=fields
            )
            await self.events.publish(event)
            return
        await self._pruned(target, volumes, pruned)

    async def _pruned(self, target: Target, volumes: list[pb.Volume], pruned: OffsitePruned) -> None:
        if pruned.kept_objects:
            log.error("off-site target %s: %s", target.url, pruned.kept_objects)
        log.info(
            "off-site target %s pruned: %d snapshot(s) and %d object(s) deleted",
            target.url,
            sum(len(ids) for ids in pruned.deleted.values()),
            pruned.objects_deleted,
        )
        for volume in volumes:
            gone = pruned.deleted.get(volume.meta.id, [])
            if not gone:
                continue
            self._copied.difference_update((target.url, s) for s in gone)
            kept = snapshots_kept(volume.snapshot_policy)
            message = (
                f"{len(gone)} snapshot(s) of volume {volume.name} ({volume.meta.id}) deleted from {target.url} "
                f"(it keeps the newest {kept} there)"
            )
            fields = {"volume": volume.meta.id, "target": target.url, "snapshots": ",".join(gone), "keep": str(kept)}
            event = env_event("volume.offsite_pruned", message, volume, clock=self.clock, fields=fields)
            await self.events.publish(event)

    async def _copy(self, target: Target, volume: pb.Volume, snap: pb.VolumeSnapshot) -> None:
        done = await copy_snapshot(self.conn, snapshot_target(), target, volume, snap)
        log.info(
            "snapshot %s of volume %s copied to %s: %d of %d object(s) sent, %d bytes",
            snap.meta.id,
            volume.meta.id,
            target.url,
            done.sent_objects,
            done.objects + 1,
            done.sent_bytes,
        )
        fields = {
            "volume": volume.meta.id,
            "snapshot": snap.meta.id,
            "target": target.url,
            "sent_bytes": str(done.sent_bytes),
            "sent_objects": str(done.sent_objects),
        }
        message = (
            f"snapshot {snap.meta.id} of volume {volume.name} ({volume.meta.id}) copied to {target.url}: "
            f"{done.sent_bytes:,} bytes sent ({done.sent_objects} of {done.objects + 1} objects)"
        )
        await self.events.publish(env_event("volume.offsite_copied", message, volume, clock=self.clock, fields=fields))

    async def _failed(self, volume: pb.Volume, snap: pb.VolumeSnapshot, cause: str) -> None:
        key = (volume.snapshot_policy.offsite_target, snap.meta.id)
        previous = self._failing.get(key)
        failures = (previous.failures if previous else 0) + 1
        self._failing[key] = Failing(failures, self.clock.now() + exponential(FIRST_RETRY, failures, LAST_RETRY))
        log.error(
            "snapshot %s of volume %s not copied off-site (%d time(s) in a row): %s",
            snap.meta.id,
            volume.meta.id,
            failures,
            cause,
        )
        fields = {
            "volume": volume.meta.id,
            "snapshot": snap.meta.id,
            "target": volume.snapshot_policy.offsite_target,
            "failures": str(failures),
        }
        message = f"snapshot {snap.meta.id} of volume {volume.name} ({volume.meta.id}) not copied off-site: {cause}"
        await self.events.publish(
            env_event("volume.offsite_failed", message, volume, clock=self.clock, severity=ERROR, fields=fields)
        )
