"""ScheduledBackups (lease ``backups``): the cluster backed up on the schedule ``zattera backup schedule`` set.

It runs in the secrets service because a backup holds the cluster secrets key, sealed to the operator's
recovery recipient, and only this service holds that key (and opens the target's sealed credentials).

- **due**: the slot after the last run's start (the schedule's own update when it never ran) fires once;
  after an outage that is one catch-up run. A failed run is retried after an exponential backoff (1 min
  doubling up to the next slot), so a transient outage of the target does not cost a whole period.
- **a run**: create the backup, read every object back against its manifest, mark it verified, then apply
  retention (the newest ``keep`` verified backups stay: shared/backup/retention.py).
- **loud failures**: a failed run is a ``backup.failed`` event and stays in ``backuprun.cluster`` (shown by
  ``zattera status`` and the console) until a later run succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.backup import CreateBackup, VerifyBackup, create_backup, verify_backup
from shared.actions.context import ActionContext
from shared.backoff import exponential
from shared.backup import retention
from shared.backup.sealed import open_settings
from shared.backup.status import SCHEDULE_ID
from shared.backup.targets import open_target
from shared.events import ERROR, make_event
from shared.loop import LeaderLoop, LoopDeps
from shared.schedule import ScheduleError, parse_schedule
from shared.secrets import Keyring

log = logging.getLogger(__name__)

TICK = 60.0
FIRST_RETRY = 60.0
"""Seconds before the first retry of a failed run (doubling with each consecutive failure)."""


def _seconds(ts: Timestamp, present: bool) -> float | None:
    return ts.ToNanoseconds() / 1e9 if present else None


@dataclass(frozen=True)
class Due:
    at: float | None
    """When the next run is due (None: never — paused, or a schedule with no next slot)."""
    why: str = ""


def next_run(schedule: pb.BackupSchedule, run: pb.BackupRun | None) -> Due:
    """When the next scheduled backup is due, from the schedule and the last run (pure)."""
    if schedule.paused:
        return Due(None, "paused")
    try:
        cron = parse_schedule(schedule.schedule)
    except ScheduleError as exc:
        return Due(None, f"bad schedule: {exc}")
    started = _seconds(run.started_at, run.HasField("started_at")) if run is not None else None
    changed = _seconds(schedule.meta.updated_at, schedule.meta.HasField("updated_at")) or 0.0
    baseline = max(started or 0.0, changed)
    slot = cron.next_after(baseline)
    if run is not None and not run.ok and started is not None and started >= changed:
        finished = _seconds(run.finished_at, run.HasField("finished_at")) or started
        most = (slot - finished) if slot is not None else 3600.0
        retry = finished + exponential(FIRST_RETRY, max(run.failures, 1), max(most, FIRST_RETRY))
        return Due(retry if slot is None else min(retry, slot), "retry")
    return Due(slot, "slot")


class ScheduledBackups(LeaderLoop):
    name = "backups"
    kinds = frozenset({K.BACKUP_SCHEDULE})

    def __init__(
        self,
        deps: LoopDeps,
        keyring: Callable[[], Keyring | None],
        *,
        local_ca_dir: Path | None = None,
        tick: float = TICK,
    ) -> None:
        super().__init__(deps, tick=tick)
        self.keyring = keyring
        self.local_ca_dir = local_ca_dir
        """The certs service's local CA directory (on this machine: the control plane's data dir), carried by
        each backup when it holds a CA."""
        self._due: float | None = None

    def seconds_until_due(self) -> float | None:
        return None if self._due is None else max(self._due - self.clock.now(), 0.0)

    def _state(self) -> tuple[pb.BackupSchedule | None, pb.BackupRun | None]:
        schedule = self.view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID)
        run = self.view.get(K.BACKUP_RUN, SCHEDULE_ID)
        return (
            schedule if isinstance(schedule, pb.BackupSchedule) else None,
            run if isinstance(run, pb.BackupRun) else None,
        )

    async def run_pass(self) -> None:
        schedule, run = self._state()
        if schedule is None:
            self._due = None
            return
        due = next_run(schedule, run)
        self._due = due.at
        if due.at is None or due.at > self.clock.now():
            return
        await self.run_backup(schedule, run)
        schedule, run = self._state()
        self._due = next_run(schedule, run).at if schedule is not None else None

    async def run_backup(self, schedule: pb.BackupSchedule, previous: pb.BackupRun | None) -> pb.BackupRun:
        """One scheduled run, its outcome written to ``backuprun.cluster`` (and returned)."""
        assert self.writer is not None
        ctx = ActionContext(self.conn, self.writer, "backups", self.clock)
        record = pb.BackupRun()
        if previous is not None:
            record.CopyFrom(previous)
        record.meta.id = SCHEDULE_ID
        record.started_at.FromNanoseconds(int(self.clock.now() * 1e9))
        try:
            credentials = open_settings(self.keyring(), schedule.sealed_credentials, schedule.key_id)
            keyring = self.keyring()
            if keyring is None:
                raise RuntimeError("the secrets service holds no cluster secrets key")
            request = CreateBackup(
                schedule.target,
                "",
                "",
                recipient=schedule.recipient.decode(),
                credentials=credentials,
                local_ca_dir=str(self.local_ca_dir or ""),
            )
            created = await create_backup(ctx, request, keyring=keyring)
        except Exception as exc:
            return await self._failed(record, str(exc), published=True)
        try:
            await verify_backup(VerifyBackup(schedule.target, created.id, credentials=credentials))
            target = open_target(schedule.target, credentials)
            await asyncio.to_thread(retention.mark_verified, target, created.id)
            pruned = await asyncio.to_thread(retention.prune, target, schedule.keep, self.clock.now())
        except Exception as exc:
            return await self._failed(record, f"backup {created.id}: {exc}", published=False)
        record.ok, record.error, record.failures = True, "", 0
        record.backup_id = created.id
        record.sent_bytes = created.sent_bytes
        record.kept, record.deleted = pruned.kept, len(pruned.deleted)
        record.finished_at.FromNanoseconds(int(self.clock.now() * 1e9))
        record.succeeded_at.CopyFrom(record.finished_at)
        await self._write(record)
        log.info(
            "scheduled backup %s: %d bytes sent, %d kept, %d deleted",
            created.id,
            created.sent_bytes,
            pruned.kept,
            len(pruned.deleted),
        )
        return record

    async def _failed(self, record: pb.BackupRun, reason: str, *, published: bool) -> pb.BackupRun:
        """``published``: :func:`create_backup` already emitted the ``backup.failed`` event."""
        record.ok, record.error = False, reason
        record.failures += 1
        record.finished_at.FromNanoseconds(int(self.clock.now() * 1e9))
        log.error("scheduled backup failed (%d in a row): %s", record.failures, reason)
        if not published:
            await self.events.publish(make_event("backup.failed", f"scheduled backup failed: {reason}", severity=ERROR))
        await self._write(record)
        return record

    async def _write(self, record: pb.BackupRun) -> None:
        assert self.writer is not None
        await self.writer.commit(self.writer.txn("backups").put(record))
