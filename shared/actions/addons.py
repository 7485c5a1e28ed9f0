"""Managed databases (``zattera addons``, docs/addons.md): create, attach, detach, restore (a point-in-time
fork), list, info and delete, one function each.

A database is an environment (``PROJECT/NAME/db``, :mod:`shared.addons.spec`): creating one is ONE fenced
write of its app, env and sealed secrets (the passwords are generated here, sealed to the cluster key at
once and never returned, logged or put in an event), then its first deploy; when that deploy cannot be
recorded the app and env are deleted again, so a failed create leaves nothing behind.

Attaching and detaching are :mod:`shared.actions.addon_attach`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit
from shared.actions.deletion import deletion_txn, plan_deletion
from shared.actions.names import env_path, find_app, find_env, resolve_project
from shared.actions.refusals import ActionRefused, Conflicting, Invalid, NotFound
from shared.actions.volumes import PolicySet, SetSnapshotPolicy, put_back_snapshot, set_snapshot_policy
from shared.actions.volumes import _dispatcher as volume_dispatcher
from shared.addons import spec as addon
from shared.addons.backups import BackupStatus, status_from_lines
from shared.addons.spec import AddonInputError
from shared.applogs import UnknownLogStream, read_app_logs
from shared.clock import from_timestamp, stamp
from shared.deploy import Deployer
from shared.events import event_for_env
from shared.ids import new_id
from shared.retry import Attempt
from shared.secrets import CLUSTER_KEY, seal
from shared.state.reader import StateReader
from shared.txn import Txn
from shared.volumes import find_volume

EVENT_CREATED = "addon.created"
EVENT_ATTACHED = "addon.attached"
EVENT_DETACHED = "addon.detached"
EVENT_RESTORED = "addon.restored"
EVENT_DELETED = "addon.deleted"

NO_CLUSTER_KEY = "no cluster secrets key: run the secrets service (`zattera up` does) before creating a database"


@dataclass(frozen=True, slots=True)
class CreateAddon:
    engine: str
    name: str
    project: str
    version: str = ""
    archive_timeout: int = addon.ARCHIVE_TIMEOUT
    backup_interval: int = addon.BACKUP_INTERVAL


@dataclass(frozen=True, slots=True)
class RestoreAddon:
    name: str
    project: str
    as_name: str
    to_time: float | None = None
    """Epoch seconds (UTC); None = the latest state the archive holds (``--latest``)."""
    source: str = ""
    """An off-site target (``s3://bucket[/prefix]`` or a directory) holding copies of the origin's ``backups``
    volume (``addons offsite``): restore from its newest copy there, not from the node's volume."""
    settings: dict[str, str] = field(default_factory=dict, repr=False)
    """The source's settings (``AWS_*``), used here only."""


@dataclass(frozen=True, slots=True)
class AddonOffsite:
    name: str
    project: str
    target: str
    """A directory or ``s3://bucket[/prefix]``; "" stops the copies."""
    schedule: str = "@every 1h"
    """How often the ``backups`` volume is snapshotted (and each snapshot copied off-site)."""
    settings: dict[str, str] = field(default_factory=dict, repr=False)
    """The target's settings (``AWS_*``), stored sealed to the cluster key."""


@dataclass(frozen=True, slots=True)
class DeleteAddon:
    name: str
    project: str
    purge: bool = False
    """Also delete its volumes (its data and its backups); kept by default."""


@dataclass(frozen=True, slots=True)
class AddonInfo:
    name: str
    project: str
    engine: str
    version: str
    env_id: str
    env: str
    """``project/name/db``."""
    address: str
    """The private name: ``name.db.project.internal:port``."""
    status: str
    """The replica's observed state (RUNNING, PENDING…; "" before the first placement)."""
    node_id: str = ""
    release_version: int = 0
    created_at: float = 0.0
    attached_to: list[str] = field(default_factory=list)
    volumes: dict[str, str] = field(default_factory=dict)
    """Volume name → id."""
    restored_from: str = ""
    restore_target: str = ""
    offsite: str = ""
    """Where its backups are copied off-site (``addons offsite``: its ``backups`` volume's policy), "" = nowhere."""


@dataclass(frozen=True, slots=True)
class AddonCreated:
    info: AddonInfo
    deployment_id: str


def _refuse(exc: AddonInputError) -> Invalid:
    return Invalid(exc.field, exc.problem)


def _project(view: StateReader, name: str) -> pb.Project:
    project = resolve_project(view, name)
    if project is None:
        raise NotFound(f"no project {name!r}", field="project")
    return project


def addon_env(view: StateReader, project: pb.Project, name: str) -> pb.Environment:
    """The database ``name`` of ``project``, else a refusal naming ``name``."""
    app = find_app(view, project.meta.id, name)
    env = find_env(view, app.meta.id, addon.ENV_NAME) if app is not None else None
    if env is None or addon.addon_of(env) is None:
        raise NotFound(f"no database {name!r} in project {project.name} (deleted, or never created)", field="name")
    return env


def info_of(view: StateReader, env: pb.Environment) -> AddonInfo:
    engine, version = addon.addon_of(env) or ("", "")
    project, app = view.project(env.project_id), view.app(env.app_id)
    pname, aname = (project.name if project else "?"), (app.name if app else "?")
    runs = [a for a in view.assignments(env.meta.id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN]
    status = pb.InstanceState.Name(runs[0].observed.state).removeprefix("INSTANCE_STATE_") if runs else ""
    release = view.release(env.active_release_id) if env.active_release_id else None
    marker = addon.attached_var(aname)
    attached = sorted(env_path(view, e) for e in view.envs() if e.service.vars.get(marker) == env.meta.id)
    volumes = view.volumes(env.meta.id)
    policies = [v.snapshot_policy for v in volumes if v.name == addon.BACKUPS_VOLUME]
    offsite = (
        f"{policies[0].offsite_target} {policies[0].schedule}".strip()
        if policies and policies[0].offsite_target
        else ""
    )
    return AddonInfo(
        name=aname,
        project=pname,
        engine=engine,
        version=version,
        env_id=env.meta.id,
        env=f"{pname}/{aname}/{env.name}",
        address=f"{aname}.{env.name}.{pname}.internal:{addon.PORTS.get(engine, 0)}",
        status="UNSPECIFIED" if status == "UNSPECIFIED" else status,
        node_id=runs[0].node_id if runs else "",
        release_version=release.version if release is not None else 0,
        created_at=from_timestamp(env.meta.created_at),
        attached_to=attached,
        volumes={v.name: v.meta.id for v in volumes},
        restored_from=env.service.vars.get(FORKED_FROM_VAR, ""),
        restore_target=env.service.vars.get("ZATTERA_PG_RESTORE_TARGET", ""),
        offsite=offsite,
    )


FORKED_FROM_VAR = "ZATTERA_ADDON_FORKED_FROM"
"""On a fork: ``project/name`` of the origin (what ``addons info`` shows)."""


def sealed_secret(
    env: pb.Environment, key: pb.SecretsKey, name: str, *, value: str = "", ciphertext: bytes = b""
) -> pb.SealedSecret:
    """A sealed secret of ``env`` (version 1 above what it holds by that name), referenced by its spec."""
    now = time.time_ns()
    version = env.service.secrets[name].version + 1 if name in env.service.secrets else 1
    record = pb.SealedSecret(
        environment_id=env.meta.id,
        project_id=env.project_id,
        name=name,
        version=version,
        ciphertext=ciphertext or seal(key.public_key, value.encode()),
        key_id=key.key_id,
    )
    record.meta.id = new_id()
    record.meta.created_at.FromNanoseconds(now)
    record.meta.updated_at.FromNanoseconds(now)
    ref = env.service.secrets[name]
    ref.secret_id, ref.version = record.meta.id, record.version
    ref.updated_at.FromNanoseconds(now)
    return record


def cluster_key(view: StateReader) -> pb.SecretsKey:
    key = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    if not isinstance(key, pb.SecretsKey) or not key.public_key:
        raise Conflicting(NO_CLUSTER_KEY)
    return key


def _new_addon_records(
    ctx: ActionContext, project: pb.Project, name: str, engine: str, spec: pb.ServiceSpec, env_id: str = ""
) -> tuple[Txn, pb.App, pb.Environment]:
    """ONE transaction: the app, its env with the generated secrets (sealed), refused when the name is taken."""
    view = ctx.view
    if find_app(view, project.meta.id, name) is not None:
        raise Conflicting(f"{name!r} is already an app of project {project.name}", field="name")
    key = cluster_key(view)
    now = ctx.clock.now()
    app = pb.App(project_id=project.meta.id, name=name)
    app.meta.id = new_id()
    stamp(app.meta.created_at, now)
    stamp(app.meta.updated_at, now)
    env = pb.Environment(
        app_id=app.meta.id, project_id=project.meta.id, name=addon.ENV_NAME, type=pb.ENVIRONMENT_TYPE_STANDARD
    )
    env.meta.id = env_id or new_id()
    stamp(env.meta.created_at, now)
    stamp(env.meta.updated_at, now)
    env.service.CopyFrom(spec)
    txn = ctx.writer.txn("addons-create").create(app)
    if engine == addon.POSTGRES:
        app_password = addon.new_password()
        txn.create(sealed_secret(env, key, addon.SUPERUSER_PASSWORD, value=addon.new_password()))
        txn.create(sealed_secret(env, key, addon.APP_PASSWORD, value=app_password))
    else:
        app_password = addon.new_password()
        txn.create(sealed_secret(env, key, addon.REDIS_PASSWORD, value=app_password))
    txn.create(sealed_secret(env, key, addon.URL_SECRET, value=addon.database_url(engine, name, app_password)))
    env.service.config_version += 1
    txn.create(env)
    txn.put(key)  # unchanged: the secrets were sealed to this key (a rotation meanwhile refuses the write)
    return txn, app, env


async def _create_and_deploy(
    ctx: ActionContext,
    project: pb.Project,
    name: str,
    engine: str,
    spec: pb.ServiceSpec,
    extra_records: list[pb.Volume] | None = None,
    env_id: str = "",
) -> tuple[pb.Environment, str]:
    def attempt() -> Attempt[pb.Environment]:
        txn, _app, env = _new_addon_records(ctx, project, name, engine, spec, env_id)
        for volume in extra_records or ():
            pinned = pb.Volume()
            pinned.CopyFrom(volume)
            pinned.environment_id = env.meta.id
            txn.create(pinned)
        return Attempt(txn, env)

    env = await commit(ctx, attempt, contended=f"project {project.name}")
    try:
        created = await Deployer(ctx.writer, clock=ctx.clock, created_by=ctx.actor).deploy(
            env.meta.id, image_ref=addon.IMAGE_REF
        )
    except BaseException:
        await _remove(ctx, env, purge=True)  # a failed create leaves nothing behind
        raise
    return env, created.deployment.meta.id


async def create_addon(ctx: ActionContext, request: CreateAddon) -> AddonCreated:
    try:
        version = addon.check_engine(request.engine, request.version)
        addon.check_name(request.name)
    except AddonInputError as exc:
        raise _refuse(exc) from None
    if not 1 <= request.archive_timeout <= 3600:
        raise Invalid("archive_timeout", "must be 1-3600 seconds")
    if not 60 <= request.backup_interval <= 30 * 86400:
        raise Invalid("backup_interval", "must be 60 s to 30 days")
    project = _project(ctx.view, request.project)
    spec = addon.service_spec(
        request.engine,
        version,
        stanza=request.name,
        archive_timeout=request.archive_timeout,
        backup_interval=request.backup_interval,
    )
    env, deployment_id = await _create_and_deploy(ctx, project, request.name, request.engine, spec)
    info = info_of(ctx.view, env)
    await ctx.events.publish(
        event_for_env(
            env,
            EVENT_CREATED,
            f"database {info.project}/{info.name} ({info.engine} {info.version}) created",
            fields={"actor": ctx.actor, "engine": info.engine, "version": info.version},
        )
    )
    return AddonCreated(info, deployment_id)


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
    env = addon_env(ctx.view, _project(ctx.view, project), name)
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
        raise _refuse(exc) from None
    project = _project(ctx.view, request.project)
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
    now = ctx.clock.now()
    pinned: list[pb.Volume] = []
    for name in (addon.DATA_VOLUME, addon.BACKUPS_VOLUME):
        volume = pb.Volume(
            project_id=project.meta.id, name=name, node_id=backups.node_id, status=pb.VOLUME_STATUS_ACTIVE
        )
        volume.meta.id = new_id()
        stamp(volume.meta.created_at, now)
        stamp(volume.meta.updated_at, now)
        pinned.append(volume)
    env, deployment_id = await _create_and_deploy(ctx, project, request.as_name, engine, spec, pinned)
    info = info_of(ctx.view, env)
    await ctx.events.publish(
        event_for_env(
            env,
            EVENT_RESTORED,
            f"database {info.project}/{info.name} restored from {project.name}/{request.name} at {target}",
            fields={"actor": ctx.actor, "origin": f"{project.name}/{request.name}", "target": target},
        )
    )
    return AddonCreated(info, deployment_id)


def _backups_volume(ctx: ActionContext, env: pb.Environment, name: str) -> pb.Volume:
    volume = find_volume(ctx.view, env.project_id, env.meta.id, addon.BACKUPS_VOLUME)
    if volume is None:
        raise Conflicting(f"{name} has no backups volume yet (its first start has not placed it)", field="name")
    return volume


async def set_addon_offsite(ctx: ActionContext, request: AddonOffsite) -> PolicySet:
    """Copy a PostgreSQL database's backups off-site: its ``backups`` volume (pgBackRest's repository) is
    snapshotted on ``schedule`` and each snapshot copied to ``target`` — the volume snapshot engine's
    off-site copy (docs/backup.md), with the target checked and its settings sealed as there."""
    project = _project(ctx.view, request.project)
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
    pinned: list[pb.Volume] = []
    for name in (addon.DATA_VOLUME, addon.BACKUPS_VOLUME):
        volume = pb.Volume(
            project_id=project.meta.id,
            environment_id=env_id,
            name=name,
            node_id=node_id,
            status=pb.VOLUME_STATUS_ACTIVE,
        )
        volume.meta.id = new_id()
        stamp(volume.meta.created_at, now)
        stamp(volume.meta.updated_at, now)
        pinned.append(volume)
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
        env, deployment_id = await _create_and_deploy(
            ctx, project, request.as_name, addon.POSTGRES, spec, env_id=env_id
        )
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
    info = info_of(ctx.view, env)
    await ctx.events.publish(
        event_for_env(
            env,
            EVENT_RESTORED,
            f"database {info.project}/{info.name} restored from {project.name}/{request.name} at {target_time}"
            f" (off-site copy {record.meta.id})",
            fields={
                "actor": ctx.actor,
                "origin": f"{project.name}/{request.name}",
                "target": target_time,
                "snapshot": record.meta.id,
            },
        )
    )
    return AddonCreated(info, deployment_id)


def _pg_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S.%f+00")


def list_addons(view: StateReader, project: str = "") -> list[AddonInfo]:
    wanted = _project(view, project).meta.id if project else ""
    return [
        info_of(view, env)
        for env in view.envs()
        if addon.addon_of(env) is not None and env.name == addon.ENV_NAME and (not wanted or env.project_id == wanted)
    ]


def addon_info(view: StateReader, name: str, project: str) -> AddonInfo:
    return info_of(view, addon_env(view, _project(view, project), name))


async def _remove(ctx: ActionContext, env: pb.Environment, *, purge: bool) -> dict[str, int]:
    def attempt() -> Attempt[dict[str, int]]:
        app = ctx.view.app(env.app_id)
        current = ctx.view.env(env.meta.id)
        plan = plan_deletion(
            ctx.view,
            f"database {app.name if app else env.app_id}",
            apps=[app] if app is not None else [],
            envs=[current] if current is not None else [],
            volumes=purge,
            now=ctx.clock.now(),
        )
        txn = deletion_txn(ctx.writer, plan)
        for secret in ctx.view.secrets(env.meta.id):
            txn.delete(K.secret(secret.meta.id))
        return Attempt(txn, plan.summary())

    return await commit(ctx, attempt, contended=f"database {env.meta.id}")


async def delete_addon(ctx: ActionContext, request: DeleteAddon) -> dict[str, int]:
    """The database's app and env (its replica stops); its volumes — the data and the backups — stay
    unless ``purge``. Refused while an env is attached (detach it first)."""
    project = _project(ctx.view, request.project)
    env = addon_env(ctx.view, project, request.name)
    info = info_of(ctx.view, env)
    if info.attached_to:
        raise Conflicting(f"attached to {', '.join(info.attached_to)}: detach first", field="name")
    summary = await _remove(ctx, env, purge=request.purge)
    await ctx.events.publish(
        event_for_env(
            env,
            EVENT_DELETED,
            f"database {project.name}/{request.name} deleted" + ("" if request.purge else " (its volumes kept)"),
            fields={"actor": ctx.actor, "purge": str(request.purge).lower()},
        )
    )
    return summary
