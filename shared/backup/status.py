"""What the scheduled backups last did, read from the state and said in a few lines (``zattera status``,
``zattera backup status``, the console). Light on imports: every read command shows it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.state.reader import StateReader

SCHEDULE_ID = "cluster"
"""The one schedule's id (``backupschedule.cluster``, ``backuprun.cluster``)."""


@dataclass(frozen=True)
class BackupStatus:
    scheduled: bool
    schedule: str = ""
    target: str = ""
    keep: int = 0
    last_run_at: float = 0.0
    ok: bool = True
    error: str = ""
    """Why the last run failed ("" when it did not): shown until a later run succeeds."""
    failures: int = 0
    last_backup_id: str = ""
    last_success_at: float = 0.0
    kept: int = 0

    @property
    def failing(self) -> bool:
        return bool(self.last_run_at) and not self.ok


def _seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def backup_status(view: StateReader) -> BackupStatus:
    """The schedule and what its last run did (``scheduled`` False when there is no schedule)."""
    schedule = view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID)
    run = view.get(K.BACKUP_RUN, SCHEDULE_ID)
    if not isinstance(run, pb.BackupRun):
        run = pb.BackupRun(ok=True)
    scheduled = isinstance(schedule, pb.BackupSchedule)
    last = _seconds(run.started_at) if run.HasField("started_at") else 0.0
    return BackupStatus(
        scheduled=scheduled,
        schedule=schedule.schedule if isinstance(schedule, pb.BackupSchedule) else "",
        target=schedule.target if isinstance(schedule, pb.BackupSchedule) else "",
        keep=schedule.keep if isinstance(schedule, pb.BackupSchedule) else 0,
        last_run_at=last,
        ok=run.ok or not last,
        error=run.error,
        failures=run.failures,
        last_backup_id=run.backup_id,
        last_success_at=_seconds(run.succeeded_at) if run.HasField("succeeded_at") else 0.0,
        kept=run.kept,
    )


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe(status: BackupStatus) -> list[str]:
    """The lines ``zattera status`` and ``backup status`` print (a failing schedule says so first)."""
    if not status.scheduled and not status.failing:
        return ["backups: none scheduled (`zattera backup schedule`)"]
    lines = []
    if status.failing:
        lines.append(
            f"backups: FAILING since {_when(status.last_run_at)} ({status.failures} run(s) in a row): {status.error}"
        )
    if status.scheduled:
        lines.append(f"backups: {status.schedule} to {status.target}, keeping {status.keep}")
    if status.last_success_at:
        lines.append(
            f"backups: last good {status.last_backup_id} at {_when(status.last_success_at)}, {status.kept} kept"
        )
    elif status.scheduled and not status.failing:
        lines.append("backups: no run yet")
    return lines
