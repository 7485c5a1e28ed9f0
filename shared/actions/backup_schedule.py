"""Scheduled backups (docs/backup.md): ``schedule_backups``, ``unschedule_backups``.

The schedule is one record (``backupschedule.cluster``) that the secrets service's ``backups`` leader loop
follows (services/secrets/backups.py). It holds nothing that opens a backup: the recovery passphrase becomes
a public recipient here, and the target's credentials are sealed to the cluster secrets key, which only the
secrets service opens. What the last run did is ``backuprun.cluster``, written by the loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit_edit, stamp_replacing
from shared.actions.fields import SealedSettings
from shared.actions.refusals import Invalid, NotFound
from shared.backup import recovery
from shared.backup.manifest import BackupError
from shared.backup.sealed import seal_settings
from shared.backup.status import SCHEDULE_ID
from shared.backup.targets import open_target
from shared.schedule import ScheduleError, parse_schedule

DEFAULT_KEEP = 14
MAX_KEEP = 10_000


@dataclass(frozen=True)
class ScheduleBackups:
    schedule: str
    target: str
    passphrase: str = field(repr=False)
    """The recovery passphrase; only a public recipient derived from it is stored."""
    keep: int = DEFAULT_KEEP
    credentials: SealedSettings = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class BackupsScheduled:
    schedule: str
    target: str
    keep: int
    credentials: list[str]
    """The names of the stored settings (never their values)."""


async def schedule_backups(ctx: ActionContext, request: ScheduleBackups) -> BackupsScheduled:
    """Record (or replace) the cluster's backup schedule, after checking the schedule, ``keep``, the
    passphrase and that the target can be written from here with the given settings."""
    try:
        parse_schedule(request.schedule)
    except ScheduleError as exc:
        raise Invalid("schedule", str(exc)) from None
    if not 1 <= request.keep <= MAX_KEEP:
        raise Invalid("keep", f"between 1 and {MAX_KEEP} (got {request.keep})")
    try:
        recovery.check_passphrase(request.passphrase)
        target = open_target(request.target, request.credentials)
        await asyncio.to_thread(target.check)
    except recovery.WeakPassphrase as exc:
        raise Invalid("passphrase", str(exc), said="") from None
    except BackupError as exc:
        raise Invalid("target", str(exc), said="") from None
    sealed = seal_settings(ctx.view, request.credentials)
    recipient = await asyncio.to_thread(recovery.recipient, request.passphrase)

    def edit() -> pb.BackupSchedule:
        record = pb.BackupSchedule(
            schedule=request.schedule,
            keep=request.keep,
            target=target.url,
            sealed_credentials=sealed.sealed,
            key_id=sealed.key_id,
            recipient=recipient,
        )
        record.meta.id = SCHEDULE_ID
        stamp_replacing(record, ctx.view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID))
        return record

    await commit_edit(ctx, "the backup schedule", edit)
    return BackupsScheduled(request.schedule, target.url, request.keep, sorted(request.credentials))


@dataclass(frozen=True)
class UnscheduleBackups:
    pass


async def unschedule_backups(ctx: ActionContext, request: UnscheduleBackups) -> None:
    """Stop the scheduled backups (backups already taken stay on the target; the last run's record goes
    too, so an old failure is no longer shown)."""
    if ctx.view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID) is None:
        raise NotFound("no backup schedule is set", field="schedule")
    txn = ctx.writer.txn().delete(K.backup_schedule(SCHEDULE_ID))
    if ctx.view.get(K.BACKUP_RUN, SCHEDULE_ID) is not None:
        txn.delete(K.backup_run(SCHEDULE_ID))
    await ctx.writer.commit(txn)
