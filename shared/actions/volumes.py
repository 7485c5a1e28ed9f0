"""A volume's snapshot policy, snapshots and restores (``zattera volumes policy|snapshot|restore``, the
console's volume buttons).

A snapshot writes its RUNNING record first and asks the volume's node to take it; a restore rebuilds the
volume from a COMPLETE snapshot on its node (refused while the volume is mounted or restoring). Both run
through the caller's :class:`~shared.snapshots.dispatch.SnapshotDispatcher`; ``wait`` says how long the
action waits for the outcome before it answers and leaves the rest to the context's background.

A policy may name an off-site target (docs/backup.md): its settings are checked against it here and stored
sealed to the cluster secrets key; the secrets service copies each COMPLETE snapshot there. A restore
``source`` fetches the snapshot from such a target into ``zattera-snapshots`` first (the local store lost
it), then rebuilds the volume as from any local snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit_edit
from shared.actions.fields import OneOffSettings, SealedSettings
from shared.actions.refusals import Invalid, NotFound
from shared.clock import stamp
from shared.schedule import ScheduleError, validate_schedule
from shared.subjects import STATE_PREFIX, STATE_STREAM

if TYPE_CHECKING:
    from shared.snapshots.dispatch import SnapshotDispatcher

MAX_KEEP_LAST = 1000


@dataclass(frozen=True)
class PolicyChange:
    """Fields of a volume's ``snapshot_policy`` to set; None leaves a field as it is."""

    schedule: str | None = None
    keep_last: int | None = None
    pre_hook: str | None = None
    offsite: Offsite | None = None

    def __bool__(self) -> bool:
        given = (self.schedule, self.keep_last, self.pre_hook, self.offsite)
        return any(value is not None for value in given)


@dataclass(frozen=True)
class Offsite:
    """A policy's off-site target ("" = none) and its settings, sealed (:mod:`shared.backup.sealed`)."""

    target: str
    sealed_settings: bytes = field(default=b"", repr=False)
    key_id: str = ""


def with_policy(volume: pb.Volume, change: PolicyChange, now: float) -> pb.Volume | None:
    """``volume`` with ``change`` applied to its snapshot policy (``updated_at`` stamped), or None when it
    would change nothing. ``zattera apps apply`` writes a volume's ``snapshot_*`` keys this way too."""
    policy = pb.SnapshotPolicy()
    policy.CopyFrom(volume.snapshot_policy)
    if change.schedule is not None:
        policy.schedule = change.schedule
    if change.keep_last is not None:
        policy.keep_last = change.keep_last
    if change.pre_hook is not None:
        policy.pre_hook = change.pre_hook
    if change.offsite is not None:
        policy.offsite_target = change.offsite.target
        policy.offsite_sealed_settings = change.offsite.sealed_settings
        policy.offsite_key_id = change.offsite.key_id
    if policy == volume.snapshot_policy:
        return None
    updated = pb.Volume()
    updated.CopyFrom(volume)
    updated.snapshot_policy.CopyFrom(policy)
    stamp(updated.meta.updated_at, now)
    return updated


@dataclass(frozen=True, slots=True)
class SetSnapshotPolicy:
    """Only the fields given (not None) change."""

    volume_id: str
    schedule: str | None = None
    """Cron, 5 fields in UTC (``CRON_TZ=Zone`` prefix, ``@daily``, ``@every 6h``); "" = manual only."""
    keep_last: int | None = None
    """COMPLETE snapshots kept, locally and on the off-site target; 0 = 7."""
    pre_hook: str | None = None
    """A shell command run in the instance before each snapshot; "" = none."""
    offsite: str | None = None
    """A directory or s3://bucket[/prefix] each COMPLETE snapshot is copied to; "" = none."""
    settings: SealedSettings = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class PolicySet:
    volume_id: str
    name: str
    schedule: str
    keep_last: int
    pre_hook: str
    offsite: str = ""
    offsite_settings: list[str] = field(default_factory=list)
    """The names of the off-site target's stored settings (never their values)."""


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    volume_id: str
    wait: float | None = None
    """Seconds to wait for the outcome (None: until it ends; 0: answer once the RUNNING record is written)."""


@dataclass(frozen=True, slots=True)
class SnapshotTaken:
    snapshot_id: str
    volume_id: str
    status: str
    """RUNNING (still going on), COMPLETE or FAILED."""
    logical_size_bytes: int = 0
    uploaded_bytes: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class RestoreVolume:
    volume_id: str
    snapshot_id: str
    """"" with a ``source``: its newest snapshot there."""
    wait: float | None = None
    """Seconds to wait for the outcome (None: until it ends); its refusals come sooner."""
    source: str = ""
    """An off-site target to fetch the snapshot from first (a directory or s3://bucket[/prefix])."""
    settings: OneOffSettings = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class VolumeRestored:
    volume_id: str
    snapshot_id: str
    finished: bool
    """False: still restoring when the wait ended (the volume shows RESTORING until it is done)."""
    fetched_bytes: int = 0
    """Bytes fetched from the ``source`` (objects the local store lacked)."""


def _change(request: SetSnapshotPolicy) -> PolicyChange:
    change = PolicyChange(request.schedule, request.keep_last, request.pre_hook)
    if not change and request.offsite is None:
        raise Invalid("schedule", "give at least one of --schedule, --keep-last, --pre-hook or --offsite", said="")
    if request.keep_last is not None and not 0 <= request.keep_last <= MAX_KEEP_LAST:
        raise Invalid("keep_last", f"must be 0 to {MAX_KEEP_LAST}")
    if request.schedule is None:
        return change
    try:
        return PolicyChange(validate_schedule(request.schedule), request.keep_last, request.pre_hook)
    except ScheduleError as exc:
        raise Invalid("schedule", str(exc)) from None


async def _offsite(ctx: ActionContext, request: SetSnapshotPolicy) -> Offsite | None:
    """The policy's new off-site target, checked to be writable from here with the given settings, which are
    sealed to the cluster key; None when the request leaves it as it is."""
    if request.offsite is None:
        return None
    if not request.offsite.strip():
        return Offsite("")
    from shared.backup.manifest import BackupError
    from shared.backup.sealed import seal_settings
    from shared.backup.targets import open_target

    try:
        target = open_target(request.offsite.strip(), request.settings)
        await asyncio.to_thread(target.check)
    except BackupError as exc:
        raise Invalid("offsite", str(exc)) from None
    sealed = seal_settings(ctx.view, request.settings)
    return Offsite(target.url, sealed.sealed, sealed.key_id)


def _volume(ctx: ActionContext, volume_id: str) -> pb.Volume:
    volume = ctx.view.volume(volume_id)
    if volume is None:
        raise NotFound(f"volume {volume_id!r} not found", field="volume_id")
    return volume


async def set_snapshot_policy(ctx: ActionContext, request: SetSnapshotPolicy) -> PolicySet:
    change = _change(request)
    _volume(ctx, request.volume_id)
    change = dataclasses.replace(change, offsite=await _offsite(ctx, request))

    def edit() -> pb.Volume | None:
        return with_policy(_volume(ctx, request.volume_id), change, ctx.clock.now())

    await commit_edit(ctx, f"volume {request.volume_id}", edit)
    volume = ctx.view.volume(request.volume_id)
    assert volume is not None
    policy = volume.snapshot_policy
    names = sorted(request.settings) if request.offsite else []
    return PolicySet(
        volume.meta.id,
        volume.name,
        policy.schedule,
        policy.keep_last,
        policy.pre_hook,
        policy.offsite_target,
        names if policy.offsite_sealed_settings else [],
    )


def _dispatcher(ctx: ActionContext) -> SnapshotDispatcher:
    if ctx.snapshots is not None:
        return ctx.snapshots
    from shared.snapshots.dispatch import operator_dispatcher

    return operator_dispatcher(ctx.conn, ctx.view, ctx.clock)


async def _within(task: asyncio.Task[Any], wait: float | None, ctx: ActionContext, what: str) -> bool:
    """Wait for ``task`` up to ``wait`` seconds (its failure raises); False: handed to the background."""
    if wait is None:
        await task
        return True
    done, _ = await asyncio.wait({task}, timeout=wait)
    if not done:
        ctx.background.follow(task, f"{what} (by {ctx.actor})")
        return False
    task.result()
    return True


async def take_snapshot(ctx: ActionContext, request: TakeSnapshot) -> SnapshotTaken:
    volume = _volume(ctx, request.volume_id)
    dispatcher = _dispatcher(ctx)
    task = await dispatcher.start_snapshot(volume, ctx.writer)
    snapshot_id = dispatcher.running_snapshot(volume.meta.id)
    if not await _within(task, request.wait, ctx, f"snapshot of volume {volume.meta.id}"):
        return SnapshotTaken(snapshot_id, volume.meta.id, "RUNNING")
    record = task.result()
    status = pb.SnapshotStatus.Name(record.status).removeprefix("SNAPSHOT_STATUS_")
    return SnapshotTaken(
        record.meta.id, volume.meta.id, status, record.logical_size_bytes, record.uploaded_bytes, record.error
    )


async def restore_volume(ctx: ActionContext, request: RestoreVolume) -> VolumeRestored:
    dispatcher = _dispatcher(ctx)
    snapshot_id, fetched = request.snapshot_id, 0
    if request.source:
        snapshot_id, fetched = await _fetch(ctx, request)
    elif not snapshot_id:
        raise Invalid("snapshot_id", "give the snapshot to restore (see `zattera volumes snapshots VOL`)")
    task = asyncio.create_task(dispatcher.restore(request.volume_id, snapshot_id, ctx.writer))
    what = f"restore of volume {request.volume_id} from {snapshot_id}"
    finished = await _within(task, request.wait, ctx, what)
    return VolumeRestored(request.volume_id, snapshot_id, finished, fetched)


async def _fetch(ctx: ActionContext, request: RestoreVolume) -> tuple[str, int]:
    """Fetch the snapshot from the request's source into ``zattera-snapshots`` (the objects the store lacks,
    each checked), and its record back into the state when it is gone; its id and the bytes fetched."""
    from shared.backup.manifest import BackupError
    from shared.backup.offsite import NotOffsite, fetch_snapshot, read_index
    from shared.backup.targets import TargetError, open_target

    volume = _volume(ctx, request.volume_id)
    try:
        target = open_target(request.source, request.settings)
        await asyncio.to_thread(target.check)
        index = await asyncio.to_thread(read_index, target, volume.meta.id, request.snapshot_id)
    except TargetError as exc:
        raise Invalid("source", str(exc)) from None
    except NotOffsite as exc:
        raise NotFound(str(exc), field="snapshot_id") from None
    except BackupError as exc:
        raise Invalid("source", str(exc)) from None
    fetched = await fetch_snapshot(ctx.conn, target, index)
    record = index.record
    if ctx.view.snapshot(record.meta.id) is None:
        await put_back_snapshot(ctx, record)
    return record.meta.id, fetched


async def put_back_snapshot(ctx: ActionContext, record: pb.VolumeSnapshot) -> None:
    """Write a snapshot's record (fetched from off-site) back into the state."""
    key = K.key_of(record)
    try:  # a deleted record leaves a marker: the write expects it
        last = (await ctx.conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + key, direct=True)).seq or 0
    except NotFoundError:
        last = 0
    await ctx.writer.commit(ctx.writer.txn("snapshot.offsite").put(record, expect=last))
