"""Restoring a managed PostgreSQL database (docs/addons.md): its backups and recoverable window as the
instance reports them, a point-in-time fork from the node's pgBackRest repository or from an off-site
copy of it, and the off-site copies themselves (``zattera addons backups``, ``restore``, ``offsite``).

A fork is a new database (:mod:`shared.actions.addons` creates it); the origin is never written.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.addons import (
    EVENT_RESTORED,
    FORKED_FROM_VAR,
    AddonCreated,
    AddonOffsite,
    RestoreAddon,
    addon_env,
    addon_project,
    announced,
    create_and_deploy,
    refuse_input,
)
from shared.actions.context import ActionContext
from shared.actions.names import find_app
from shared.actions.refusals import ActionRefused, Conflicting, Invalid, NotFound
from shared.actions.volumes import PolicySet, SetSnapshotPolicy, put_back_snapshot, set_snapshot_policy
from shared.actions.volumes import _dispatcher as volume_dispatcher
from shared.addons import spec as addon
from shared.addons.backups import BackupStatus, status_from_lines
from shared.addons.spec import AddonInputError
from shared.applogs import UnknownLogStream, read_app_logs
from shared.clock import from_timestamp
from shared.ids import new_id
from shared.records import new_meta
from shared.volumes import find_volume

REPORT_LINES = 400
"""How many of a database's last log lines are searched for its backup report."""


async def backup_status(ctx: ActionContext, env: pb.Environment) -> BackupStatus | None:
    """The database's backups and recoverable window, as its instance last reported them (None: no report
    yet, e.g. before its first base backup)."""
    lines: list[tuple[float, str]] = []
    try:
        async for line in read_app_logs(ctx.conn, env.meta.id, last=REPORT_LINES):
            lines.append((line.time_ns / 1e9, line.line))
    except UnknownLogStream:
        return None
    return status_from_lines(lines)


async def addon_backups(ctx: ActionContext, name: str, project: str) -> BackupStatus:
    env = addon_env(ctx.view, addon_project(ctx.view, project), name)
    if (addon.addon_of(env) or ("", ""))[0] != addon.POSTGRES:
        raise Invalid("name", f"{name} is not a PostgreSQL database: its data is in volume snapshots")
    status = await backup_status(ctx, env)
    if status is None:
        raise Conflicting(f"{name} has reported no backup yet (it reports after its first base backup)", field="name")
    return status


def check_restore_time(
    to_time: float | None, created_at: float, now: float, status: BackupStatus | None = None
) -> None:
    """Refuse a target the archive cannot hold: in the future, before the oldest base backup (before the
    database existed when it reported none), after the last archived WAL as a later report says."""
    if to_time is None:
        return
    if to_time > now:
        raise Invalid("to_time", f"{_utc(to_time)} is in the future (now {_utc(now)})")
    if status is not None and status.window_start and to_time < status.window_start:
        raise Invalid(
            "to_time",
            f"{_utc(to_time)} is before the recoverable window ({_utc(status.window_start)} to"
            f" {_utc(status.window_end)})",
        )
    # Refused only on a report made after the target that still ends before it (the WAL holding the target
    # was not archived then); an older report says nothing of what was archived since.
    if status is not None and status.window_end and status.window_end < to_time < status.reported_at:
        raise Invalid(
            "to_time",
            f"{_utc(to_time)} is after the last archived WAL ({_utc(status.window_end)}): retry once it is"
            " archived (at most archive_timeout), or use --latest",
        )
    if to_time < created_at:
        raise Invalid(
            "to_time", f"{_utc(to_time)} is before the recoverable window (the database was created {_utc(created_at)})"
        )


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


async def restore_addon(ctx: ActionContext, request: RestoreAddon) -> AddonCreated:
    """A new database from the origin's base backup and WAL up to ``to_time`` (or the latest), on the
    origin's node (the fork's volumes are created pinned there: its agent copies the origin's repository
    into the fork's ``backups`` volume before the first start); the origin is never written."""
    try:
        addon.check_name(request.as_name, "as_name")
    except AddonInputError as exc:
        raise refuse_input(exc) from None
    project = addon_project(ctx.view, request.project)
    origin = addon_env(ctx.view, project, request.name)
    engine, version = addon.addon_of(origin) or ("", "")
    if engine != addon.POSTGRES:
        raise Invalid("name", f"{request.name} is a {engine} database: point-in-time restore is PostgreSQL's")
    if request.source:
        return await _restore_from_offsite(ctx, request, project, origin, version)
    status = await backup_status(ctx, origin) if request.to_time is not None else None
    check_restore_time(request.to_time, from_timestamp(origin.meta.created_at), ctx.clock.now(), status)
    backups = find_volume(ctx.view, origin.project_id, origin.meta.id, addon.BACKUPS_VOLUME)
    if backups is None or not backups.node_id:
        raise Conflicting(f"{request.name} has no backups yet (its first start has not placed it)", field="name")
    target = "latest" if request.to_time is None else _pg_time(request.to_time)
    fork = addon.Fork(backups.meta.id, origin.service.vars.get("ZATTERA_PG_STANZA", request.name), target)
    spec = addon.service_spec(engine, version, stanza=request.as_name, fork=fork)
    spec.vars[FORKED_FROM_VAR] = f"{project.name}/{request.name}"
    pinned = _pinned_volumes(project, backups.node_id, ctx.clock.now())
    env, deployment_id = await create_and_deploy(ctx, project, request.as_name, engine, spec, pinned)
    return await _restored(ctx, env, deployment_id, f"{project.name}/{request.name}", target)


async def _restored(
    ctx: ActionContext, env: pb.Environment, deployment_id: str, origin: str, target: str, snapshot: str = ""
) -> AddonCreated:
    """The fork once its ``addon.restored`` event is published (``snapshot``: the off-site copy it came from)."""
    copy = f" (off-site copy {snapshot})" if snapshot else ""
    fields = {"origin": origin, "target": target} | ({"snapshot": snapshot} if snapshot else {})
    return await announced(
        ctx,
        env,
        deployment_id,
        EVENT_RESTORED,
        lambda info: f"database {info.project}/{info.name} restored from {origin} at {target}{copy}",
        lambda _info: fields,
    )


def _pinned_volumes(project: pb.Project, node_id: str, now: float, env_id: str = "") -> list[pb.Volume]:
    """The fork's ``data`` and ``backups`` volumes, new and pinned to ``node_id``."""
    pinned: list[pb.Volume] = []
    for name in (addon.DATA_VOLUME, addon.BACKUPS_VOLUME):
        volume = pb.Volume(
            project_id=project.meta.id,
            environment_id=env_id,
            name=name,
            node_id=node_id,
            status=pb.VOLUME_STATUS_ACTIVE,
        )
        new_meta(volume.meta, now)
        pinned.append(volume)
    return pinned


def _backups_volume(ctx: ActionContext, env: pb.Environment, name: str) -> pb.Volume:
    volume = find_volume(ctx.view, env.project_id, env.meta.id, addon.BACKUPS_VOLUME)
    if volume is None:
        raise Conflicting(f"{name} has no backups volume yet (its first start has not placed it)", field="name")
    return volume


async def set_addon_offsite(ctx: ActionContext, request: AddonOffsite) -> PolicySet:
    """Copy a PostgreSQL database's backups off-site: its ``backups`` volume (pgBackRest's repository) is
    snapshotted on ``schedule`` and each snapshot copied to ``target`` — the volume snapshot engine's
    off-site copy (docs/backup.md), with the target checked and its settings sealed as there."""
    project = addon_project(ctx.view, request.project)
    env = addon_env(ctx.view, project, request.name)
    if (addon.addon_of(env) or ("", ""))[0] != addon.POSTGRES:
        raise Invalid("name", f"{request.name} is not a PostgreSQL database: set its data volume's policy")
    volume = _backups_volume(ctx, env, request.name)
    policy = SetSnapshotPolicy(
        volume.meta.id,
        schedule=request.schedule if request.target else None,
        offsite=request.target,
        settings=request.settings,
    )
    return await set_snapshot_policy(ctx, policy)


async def _restore_from_offsite(
    ctx: ActionContext, request: RestoreAddon, project: pb.Project, origin: pb.Environment, version: str
) -> AddonCreated:
    """The fork from the newest copy of the origin's ``backups`` volume on ``request.source``: its objects
    fetched back into the snapshot store (each checked), restored into the fork's OWN new ``backups`` volume
    on a live node before the fork's env is written, then the fork restores from that repository as from the
    node's copy. Nothing of the origin is read on any node (its volume may be gone with its node)."""
    from shared.backup.manifest import BackupError
    from shared.backup.offsite import NotOffsite, fetch_snapshot, read_index
    from shared.backup.targets import TargetError, open_target
    from shared.backup.volumes import new_homes

    if find_app(ctx.view, project.meta.id, request.as_name) is not None:
        raise Conflicting(f"{request.as_name!r} is already an app of project {project.name}", field="as_name")
    origin_backups = _backups_volume(ctx, origin, request.name)
    try:
        target = open_target(request.source, request.settings)
        await asyncio.to_thread(target.check)
        index = await asyncio.to_thread(read_index, target, origin_backups.meta.id)
    except NotOffsite as exc:
        raise NotFound(f"{exc} (set one with `zattera addons offsite`)", field="source") from None
    except (TargetError, BackupError) as exc:
        raise Invalid("source", str(exc)) from None
    copied_at = from_timestamp(index.record.meta.created_at)
    now = ctx.clock.now()
    if request.to_time is not None:
        check_restore_time(request.to_time, from_timestamp(origin.meta.created_at), now)
        if request.to_time > copied_at:
            raise Invalid(
                "to_time",
                f"{_utc(request.to_time)} is after the newest off-site copy ({_utc(copied_at)}): give an earlier"
                " time, or --latest (what that copy holds)",
            )
    homes = new_homes([origin_backups], ctx.view.nodes())
    node_id = homes.get(origin_backups.meta.id, "")
    if not node_id:
        raise Conflicting("no schedulable node to restore the database onto", field="as_name")
    try:
        await fetch_snapshot(ctx.conn, target, index)
    except BackupError as exc:
        raise Invalid("source", str(exc)) from None
    record = index.record
    if ctx.view.snapshot(record.meta.id) is None:
        await put_back_snapshot(ctx, record)
    env_id = new_id()
    pinned = _pinned_volumes(project, node_id, now, env_id)
    txn = ctx.writer.txn("addons-offsite-volumes")
    for volume in pinned:
        txn.create(volume)
    await ctx.writer.commit(txn)
    created = False
    try:
        dispatcher = volume_dispatcher(ctx)
        await dispatcher.restore(pinned[1].meta.id, record.meta.id, ctx.writer)
        target_time = "latest" if request.to_time is None else _pg_time(request.to_time)
        stanza = origin.service.vars.get("ZATTERA_PG_STANZA", request.name)
        fork = addon.Fork("", stanza, target_time, from_snapshot=record.meta.id)
        spec = addon.service_spec(addon.POSTGRES, version, stanza=request.as_name, fork=fork)
        spec.vars[FORKED_FROM_VAR] = f"{project.name}/{request.name}"
        env, deployment_id = await create_and_deploy(ctx, project, request.as_name, addon.POSTGRES, spec, env_id=env_id)
        created = True
    except Exception as exc:
        if not created:  # a failed restore leaves nothing behind: the fork's volumes go
            txn = ctx.writer.txn("addons-offsite-undo")
            for volume in pinned:
                txn.delete(K.key_of(volume))
            with contextlib.suppress(Exception):
                await ctx.writer.commit(txn)
        if isinstance(exc, ActionRefused):
            raise
        raise Conflicting(f"restore from {target.url} failed: {exc}", field="source") from None
    return await _restored(ctx, env, deployment_id, f"{project.name}/{request.name}", target_time, record.meta.id)


def _pg_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S.%f+00")
