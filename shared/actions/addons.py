"""Managed databases (``zattera addons``, docs/addons.md): create, list, info and delete, one function
each.

A database is an environment (``PROJECT/NAME/db``, :mod:`shared.addons.spec`): creating one is ONE fenced
write of its app, env and sealed secrets (the passwords are generated here, sealed to the cluster key at
once and never returned, logged or put in an event), then its first deploy; when that deploy cannot be
recorded the app and env are deleted again, so a failed create leaves nothing behind.

Attaching and detaching are :mod:`shared.actions.addon_attach`; backups, restores and off-site copies
:mod:`shared.actions.addon_restore`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit
from shared.actions.deletion import deletion_txn, plan_deletion
from shared.actions.fields import EnvPath, OneOffSettings, SealedSettings
from shared.actions.names import env_path, find_app, find_env, resolve_project
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.actions.secrets import secret_version
from shared.addons import spec as addon
from shared.addons.spec import AddonInputError
from shared.clock import from_timestamp
from shared.records import new_meta
from shared.retry import Attempt
from shared.secrets import CLUSTER_KEY
from shared.state.reader import StateReader
from shared.txn import Txn

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
    settings: OneOffSettings = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class AddonOffsite:
    name: str
    project: str
    target: str
    """A directory or ``s3://bucket[/prefix]``; "" stops the copies."""
    schedule: str = "@every 1h"
    """How often the ``backups`` volume is snapshotted (and each snapshot copied off-site)."""
    settings: SealedSettings = field(default_factory=dict, repr=False)


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
    env: EnvPath
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


def refuse_input(exc: AddonInputError) -> Invalid:
    """An add-on input error as the refusal naming its field."""
    return Invalid(exc.field, exc.problem)


def addon_project(view: StateReader, name: str) -> pb.Project:
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
    version = env.service.secrets[name].version + 1 if name in env.service.secrets else 1
    return secret_version(env, key, name, version, value=value, ciphertext=ciphertext)


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
    new_meta(app.meta, now)
    env = pb.Environment(
        app_id=app.meta.id, project_id=project.meta.id, name=addon.ENV_NAME, type=pb.ENVIRONMENT_TYPE_STANDARD
    )
    new_meta(env.meta, now, env_id)
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


async def create_and_deploy(
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
        created = await ctx.deployer().deploy(env.meta.id, image_ref=addon.IMAGE_REF)
    except BaseException:
        await _remove(ctx, env, purge=True)  # a failed create leaves nothing behind
        raise
    return env, created.deployment.meta.id


async def create_addon(ctx: ActionContext, request: CreateAddon) -> AddonCreated:
    try:
        version = addon.check_engine(request.engine, request.version)
        addon.check_name(request.name)
    except AddonInputError as exc:
        raise refuse_input(exc) from None
    if not 1 <= request.archive_timeout <= 3600:
        raise Invalid("archive_timeout", "must be 1-3600 seconds")
    if not 60 <= request.backup_interval <= 30 * 86400:
        raise Invalid("backup_interval", "must be 60 s to 30 days")
    project = addon_project(ctx.view, request.project)
    spec = addon.service_spec(
        request.engine,
        version,
        stanza=request.name,
        archive_timeout=request.archive_timeout,
        backup_interval=request.backup_interval,
    )
    env, deployment_id = await create_and_deploy(ctx, project, request.name, request.engine, spec)
    return await announced(
        ctx,
        env,
        deployment_id,
        EVENT_CREATED,
        lambda info: f"database {info.project}/{info.name} ({info.engine} {info.version}) created",
        lambda info: {"engine": info.engine, "version": info.version},
    )


async def announced(
    ctx: ActionContext,
    env: pb.Environment,
    deployment_id: str,
    kind: str,
    message: Callable[[AddonInfo], str],
    fields: Callable[[AddonInfo], dict[str, str]],
) -> AddonCreated:
    """A new database (created or forked) once its event is published: ``kind``, with the message and fields
    made from its info, and the actor."""
    info = info_of(ctx.view, env)
    await ctx.announce(kind, message(info), env=env, **fields(info))
    return AddonCreated(info, deployment_id)


def list_addons(view: StateReader, project: str = "") -> list[AddonInfo]:
    wanted = addon_project(view, project).meta.id if project else ""
    return [
        info_of(view, env)
        for env in view.envs()
        if addon.addon_of(env) is not None and env.name == addon.ENV_NAME and (not wanted or env.project_id == wanted)
    ]


def addon_info(view: StateReader, name: str, project: str) -> AddonInfo:
    return info_of(view, addon_env(view, addon_project(view, project), name))


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
    project = addon_project(ctx.view, request.project)
    env = addon_env(ctx.view, project, request.name)
    info = info_of(ctx.view, env)
    if info.attached_to:
        raise Conflicting(f"attached to {', '.join(info.attached_to)}: detach first", field="name")
    summary = await _remove(ctx, env, purge=request.purge)
    kept = "" if request.purge else " (its volumes kept)"
    message = f"database {project.name}/{request.name} deleted{kept}"
    await ctx.announce(EVENT_DELETED, message, env=env, purge=str(request.purge).lower())
    return summary
