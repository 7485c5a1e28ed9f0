"""SnapshotScheduler (lease ``snapshots``): scheduled volume snapshots and their retention.

Each pass, for every volume:

- **schedule**: 5-field cron in UTC, ``CRON_TZ=``/``TZ=`` prefixes, descriptors (``@daily``…,
  ``@every <Go duration>``). ``baseline`` = the newest of the volume's creation and all its snapshot
  records; the slot ``Next(baseline)`` fires once when due. After an outage that is at most one
  catch-up snapshot, since the catch-up's record becomes the next baseline.
- **retention**: COMPLETE snapshots beyond ``keep_last`` (default 7) are deleted, then pruned.

Failures never wedge a volume:

- a dispatch that fails before its record exists does not wedge the schedule: the dispatcher
  writes the RUNNING record first, and when even that write fails the slot is re-armed and retried after
  ``RETRY_AFTER`` seconds;
- at most one snapshot of a volume at a time: a due slot waits while one runs, then fires once;
- FAILED records are deleted after ``FAILED_KEEP`` (except the volume's newest record, so the baseline
  never moves back and re-fires an old slot), RUNNING records without progress for ``STUCK_AFTER`` are
  failed; their ids are pruned like expired ones;
- only record deletions that landed are pruned; a deferred or failed prune is retried;
- RESTORING and NODE_LOST volumes are not snapshotted on schedule: the slot fires once when the
  volume is back.

And a reaper for restores whose driver died: the restore runs in the process that asked for it (the CLI),
which sets the volume RESTORING and touches its ``updated_at`` while the node reports progress. A volume
RESTORING with no such sign of life for ``restore_timeout`` (``ZATTERA_RESTORE_TIMEOUT``, 1 h) is put back
to a usable state, ACTIVE when its node is ALIVE, NODE_LOST otherwise (the status it had before the
restore was known only to the dead process; these are the two a restore starts from), with a
``volume.restore_failed`` event, so its service can be placed and leased again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.scheduler.decisions import volume_event
from shared import keys as K
from shared.addons.spec import platform_schedule
from shared.clock import from_timestamp, stamp
from shared.decision import Decision
from shared.events import WARNING
from shared.loop import LeaderLoop, LoopDeps
from shared.schedule import Schedule, ScheduleError, parse_schedule
from shared.settings import DEFAULTS
from shared.snapshots.guards import RecordNotWritten, SnapshotBusy, SnapshotKeyMismatch
from shared.state.reader import StateReader
from shared.txn import Writer
from shared.volumes import snapshots_kept

log = logging.getLogger(__name__)

TICK = 30.0
STUCK_AFTER = 3600.0
FAILED_KEEP = 24 * 3600.0
RETRY_AFTER = 30.0
STUCK_ERROR = "no progress for 1h: snapshot abandoned"


def snapshot_baseline(volume: pb.Volume, records: Iterable[pb.VolumeSnapshot]) -> float:
    """The volume's creation or its newest snapshot record of any status, whichever is later."""
    return max([from_timestamp(volume.meta.created_at), *(from_timestamp(r.meta.created_at) for r in records)])


def slot_to_fire(schedule: Schedule, baseline: float, now: float, last_fire: float) -> float | None:
    """The due slot to fire now, or None (not due yet, none left, or already fired this term)."""
    due = schedule.next_after(baseline)
    if due is None or due > now or due <= last_fire:
        return None
    return due


# ---------------------------------------------------------------------------- retention and reaping


def _newest_first(records: Iterable[pb.VolumeSnapshot]) -> list[pb.VolumeSnapshot]:
    return sorted(records, key=lambda r: (from_timestamp(r.meta.created_at), r.meta.id), reverse=True)


def retention_victims(records: Iterable[pb.VolumeSnapshot], policy: pb.SnapshotPolicy) -> list[pb.VolumeSnapshot]:
    """COMPLETE snapshots beyond the newest the policy keeps (``keep_last``; 0 = the default 7)."""
    keep = snapshots_kept(policy)
    complete = [r for r in records if r.status == pb.SNAPSHOT_STATUS_COMPLETE]
    return _newest_first(complete)[keep:]


def expired_failures(records: Iterable[pb.VolumeSnapshot], now: float) -> list[pb.VolumeSnapshot]:
    """FAILED records older than ``FAILED_KEEP``, except the volume's newest record (the baseline)."""
    ordered = _newest_first(records)
    return [r for r in ordered[1:] if r.status == pb.SNAPSHOT_STATUS_FAILED and now - _last_activity(r) >= FAILED_KEEP]


def _last_activity(record: pb.VolumeSnapshot) -> float:
    return max(from_timestamp(record.meta.created_at), from_timestamp(record.meta.updated_at))


def abandoned_restores(view: StateReader, now: float, timeout: float) -> list[Decision]:
    """RESTORING volumes untouched for ``timeout``: back to ACTIVE (node ALIVE) or NODE_LOST, one write each."""
    result: list[Decision] = []
    for volume in view.volumes():
        if volume.status != pb.VOLUME_STATUS_RESTORING:
            continue
        quiet = now - max(from_timestamp(volume.meta.created_at), from_timestamp(volume.meta.updated_at))
        if quiet < timeout:
            continue
        node = view.node(volume.node_id)
        alive = node is not None and node.status == pb.NODE_STATUS_ALIVE
        reset = pb.Volume()
        reset.CopyFrom(volume)
        reset.status = pb.VOLUME_STATUS_ACTIVE if alive else pb.VOLUME_STATUS_NODE_LOST
        stamp(reset.meta.updated_at, now)
        back = "active" if alive else f"node_lost (node {volume.node_id} is not alive)"
        message = (
            f'restore of volume "{volume.name}" abandoned: no progress for {quiet:.0f}s '
            f"(the process running it is gone); volume back to {back}"
        )
        ev = volume_event(view, volume, "volume.restore_failed", message, now, severity=WARNING, node_id=volume.node_id)
        result.append(Decision(f"restore.abandoned:{volume.meta.id}", puts=[reset], events=[ev]))
    return result


def stuck_runs(records: Iterable[pb.VolumeSnapshot], now: float, progress: dict[str, float]) -> list[str]:
    """RUNNING records with no progress (record touch or a followed progress message) for 1 h."""
    return [
        r.meta.id
        for r in records
        if r.status == pb.SNAPSHOT_STATUS_RUNNING
        and now - max(_last_activity(r), progress.get(r.meta.id, 0.0)) >= STUCK_AFTER
    ]


# ---------------------------------------------------------------------------- the loop


class SnapshotOps(Protocol):
    """What the scheduler needs of the dispatcher (tests substitute a recorder)."""

    def volume_busy(self, volume_id: str) -> bool: ...

    def last_progress(self, snapshot_id: str) -> float | None: ...

    async def start_snapshot(self, volume: pb.Volume, writer: Writer) -> asyncio.Task[pb.VolumeSnapshot]: ...

    async def prune(self, volume: pb.Volume, snapshot_ids: list[str]) -> cpb.PruneSnapshotsResponse: ...


class SnapshotScheduler(LeaderLoop):
    name = "snapshots"
    kinds = frozenset({K.VOLUME, K.SNAPSHOT})

    def __init__(
        self,
        deps: LoopDeps,
        *,
        dispatcher: SnapshotOps,
        tick: float = TICK,
        restore_timeout: float = DEFAULTS.restore_timeout,
    ) -> None:
        super().__init__(deps, tick=tick)
        self.dispatcher = dispatcher
        self.restore_timeout = restore_timeout
        self._last_fire: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}
        self._warned: set[tuple[str, str]] = set()
        self._background: set[asyncio.Task[object]] = set()
        self._prunes: set[asyncio.Task[object]] = set()
        self._gc_retry: pb.Volume | None = None
        self._gc_retry_at = 0.0

    def on_term_start(self) -> None:
        self._last_fire.clear()
        self._retry_at.clear()
        self._warned.clear()

    async def end_term(self) -> None:
        """The snapshots and prunes this term started stop with it."""
        tasks = self._background | self._prunes
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _track(self, task: asyncio.Task[object], into: set[asyncio.Task[object]]) -> None:
        into.add(task)
        task.add_done_callback(into.discard)

    async def run_pass(self) -> None:
        assert self.writer is not None
        now = self.clock.now()
        await self.commit_decisions(abandoned_restores(self.view, now, self.restore_timeout))
        await self._fail_stuck(now)
        by_volume: dict[str, list[pb.VolumeSnapshot]] = defaultdict(list)
        for record in self.view.snapshots():
            by_volume[record.volume_id].append(record)
        for volume in self.view.volumes():
            records = by_volume.get(volume.meta.id, [])
            await self._maybe_snapshot(volume, records, now)
            await self._enforce_retention(volume, records, now)
        if self._gc_retry is not None and not self._prunes and now >= self._gc_retry_at:
            volume, self._gc_retry = self._gc_retry, None
            self._spawn_prune(volume, [])

    async def _fail_stuck(self, now: float) -> None:
        records = self.view.snapshots()
        progress = {r.meta.id: p for r in records if (p := self.dispatcher.last_progress(r.meta.id)) is not None}
        failures: list[Decision] = []
        for snapshot_id in stuck_runs(records, now, progress):
            current = self.view.snapshot(snapshot_id)
            if current is None:
                continue
            failed = pb.VolumeSnapshot()
            failed.CopyFrom(current)
            failed.status = pb.SNAPSHOT_STATUS_FAILED
            failed.error = STUCK_ERROR
            failures.append(Decision("snapshot.stuck", puts=[failed]))
        await self.commit_decisions(failures)

    async def _maybe_snapshot(self, volume: pb.Volume, records: list[pb.VolumeSnapshot], now: float) -> None:
        assert self.writer is not None
        volume_id = volume.meta.id
        text = volume.snapshot_policy.schedule or platform_schedule(self.view.env(volume.environment_id), volume)
        if not text or volume.status in (pb.VOLUME_STATUS_RESTORING, pb.VOLUME_STATUS_NODE_LOST):
            return
        if self.dispatcher.volume_busy(volume_id) or now < self._retry_at.get(volume_id, 0.0):
            return
        try:
            schedule = parse_schedule(text)
        except ScheduleError as exc:
            if (volume_id, text) not in self._warned:
                self._warned.add((volume_id, text))
                log.warning("volume %s: snapshot schedule ignored: %s", volume_id, exc)
            return
        previous = self._last_fire.get(volume_id, 0.0)
        due = slot_to_fire(schedule, snapshot_baseline(volume, records), now, previous)
        if due is None:
            return
        self._last_fire[volume_id] = due
        try:
            task = await self.dispatcher.start_snapshot(volume, self.writer)
        except SnapshotBusy:
            self._last_fire[volume_id] = previous
            return
        except (RecordNotWritten, SnapshotKeyMismatch) as exc:
            self._last_fire[volume_id] = previous
            self._retry_at[volume_id] = now + RETRY_AFTER
            log.warning("volume %s: scheduled snapshot not started, retrying in %.0fs: %s", volume_id, RETRY_AFTER, exc)
            return
        self._track(task, self._background)

    async def _enforce_retention(self, volume: pb.Volume, records: list[pb.VolumeSnapshot], now: float) -> None:
        victims = retention_victims(records, volume.snapshot_policy) + expired_failures(records, now)
        if not victims:
            return
        landed = await self.commit_decisions(
            [Decision("snapshot.retention", deletes=[K.snapshot(v.meta.id)]) for v in victims]
        )
        deleted = [v.meta.id for v, ok in zip(victims, landed, strict=True) if ok]
        if deleted:
            self._spawn_prune(volume, deleted)

    def _spawn_prune(self, volume: pb.Volume, snapshot_ids: list[str]) -> None:
        async def prune() -> None:
            try:
                response = await self.dispatcher.prune(volume, snapshot_ids)
            except Exception as exc:
                response = cpb.PruneSnapshotsResponse(error=str(exc) or type(exc).__name__)
            if response.error:
                log.warning("snapshot prune (volume %s) incomplete, will retry: %s", volume.meta.id, response.error)
                self._gc_retry, self._gc_retry_at = volume, self.clock.now() + RETRY_AFTER
            else:
                log.info(
                    "snapshot prune: %d manifests, %d chunks deleted",
                    response.deleted_manifests,
                    response.deleted_chunks,
                )

        self._track(asyncio.create_task(prune()), self._prunes)


__all__ = [
    "SnapshotScheduler",
    "abandoned_restores",
    "expired_failures",
    "retention_victims",
    "slot_to_fire",
    "snapshot_baseline",
    "stuck_runs",
]
