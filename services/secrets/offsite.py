"""OffsiteSnapshots (lease ``snapshot-offsite``): each COMPLETE snapshot of a volume whose policy names an
off-site target is copied there after it is taken (:mod:`shared.backup.offsite`: only the chunks the target
lacks, the index last).

It runs in the secrets service because the target's settings are sealed to the cluster secrets key, which
only this service holds. What is on a target is learnt once per term by listing each volume's indexes there,
then remembered; a snapshot copied is ``volume.offsite_copied``. **A failed copy is loud**: a
``volume.offsite_failed`` event (error) with the cause, retried after 1 minute, doubling up to an hour,
each failure an event again. Causes name the target and the S3 error, never a setting's value.
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
from shared.backup.sealed import open_settings
from shared.backup.targets import Target, open_target
from shared.events import ERROR, env_event
from shared.loop import LeaderLoop, LoopDeps
from shared.secrets import Keyring
from shared.snapshots.guards import snapshot_target

log = logging.getLogger(__name__)

TICK = 300.0
FIRST_RETRY = 60.0
LAST_RETRY = 3600.0


def pending(volumes: list[pb.Volume], snapshots: list[pb.VolumeSnapshot]) -> list[tuple[pb.Volume, pb.VolumeSnapshot]]:
    """Each COMPLETE snapshot of a volume whose policy names an off-site target, with its volume, oldest
    first (pure)."""
    offsite = {v.meta.id: v for v in volumes if v.snapshot_policy.offsite_target}
    found = [
        (offsite[s.volume_id], s)
        for s in snapshots
        if s.status == pb.SNAPSHOT_STATUS_COMPLETE and s.volume_id in offsite
    ]
    return sorted(found, key=lambda p: (p[1].meta.created_at.ToNanoseconds(), p[1].meta.id))


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
        self._copied: set[tuple[str, str]] = set()
        """(target URL, snapshot id) known to be on the target."""
        self._listed: set[tuple[str, str]] = set()
        """(target URL, volume id) whose indexes on the target were listed this term."""
        self._failing: dict[tuple[str, str], Failing] = {}

    def on_term_start(self) -> None:
        self._copied.clear()
        self._listed.clear()
        self._failing.clear()

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
