"""Databases declared in a ``zattera.toml`` (``[addons.NAME]``, docs/addons.md): what ``zattera apps apply``
does for them, through the same actions as ``zattera addons create|attach|detach``.

:func:`plan_addons` reads the state and says, per database and per env, what is to be done (create,
attach, detach, or nothing); :func:`apply_addons` does it. Applying the same file again does nothing: a
database found by its name is kept as it is (never re-created, never deleted by a file), an env already
attached is left alone. The envs of the file's app that a declared database is attached to but that its
``attach`` no longer names are detached (the file says which of the app's envs get it); envs of other
apps are changed only when named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from shared.actions.addon_attach import AttachAddon, attach_addon, detach_addon
from shared.actions.addons import CreateAddon, create_addon
from shared.actions.context import ActionContext
from shared.actions.fields import EnvPath
from shared.actions.names import env_path, find_app, find_env, find_project
from shared.actions.refusals import ActionRefused, Conflicting
from shared.addons import spec as addon
from shared.state.reader import StateReader

CREATE, ATTACH, DETACH, UNCHANGED = "create", "attach", "detach", "unchanged"


@dataclass(frozen=True, slots=True)
class DeclaredAddon:
    name: str
    engine: str
    version: str = ""
    attach: tuple[str, ...] = ()
    """Env names of the file's app, ``app/env`` or ``project/app/env`` (of the file's project)."""
    archive_timeout: int = addon.ARCHIVE_TIMEOUT
    backup_interval: int = addon.BACKUP_INTERVAL


@dataclass(frozen=True, slots=True)
class AddonStep:
    action: str
    """create | attach | detach | unchanged."""
    database: str
    env: EnvPath = ""
    """For attach/detach (and an unchanged attachment)."""
    note: str = ""


@dataclass
class AddonsApplied:
    steps: list[AddonStep] = field(default_factory=list)
    deployments: list[str] = field(default_factory=list)


def _label(project: str, app: str, ref: str) -> str:
    parts = ref.split("/")
    return "/".join([project, app, ref] if len(parts) == 1 else [project, *parts] if len(parts) == 2 else parts)


def _field(name: str, exc: ActionRefused) -> ActionRefused:
    """The refusal of an action, naming the file's key (``addons.db.version``) instead of the option."""
    where = {"name": "", "engine": ".type", "version": ".version", "env": ".attach"}.get(exc.field, f".{exc.field}")
    key = f"addons.{name}{where}"
    refused = type(exc).__new__(type(exc))
    ActionRefused.__init__(refused, exc.problem, field=key, message=f"{key}: {exc.problem}")
    return refused


def _conflict(key: str, problem: str) -> Conflicting:
    return Conflicting(problem, field=key, message=f"{key}: {problem}")


def plan_addons(view: StateReader, project: str, app: str, declared: list[DeclaredAddon]) -> list[AddonStep]:
    """What applying ``declared`` would do now; a database of another engine or version under a declared
    name is refused naming the field."""
    steps: list[AddonStep] = []
    found = find_project(view, project)
    file_app = find_app(view, found.meta.id, app) if found is not None else None
    for item in declared:
        database = None
        if found is not None:
            db_app = find_app(view, found.meta.id, item.name)
            database = find_env(view, db_app.meta.id, addon.ENV_NAME) if db_app is not None else None
            if db_app is not None and (database is None or addon.addon_of(database) is None):
                raise _conflict(f"addons.{item.name}", f"{item.name!r} is already an app of project {project}")
        if database is None:
            steps.append(AddonStep(CREATE, item.name, note=f"{item.engine} {item.version or 'default'}"))
        else:
            engine, version = addon.addon_of(database) or ("", "")
            if engine != item.engine:
                raise _conflict(f"addons.{item.name}.type", f"{item.name} is a {engine} database already")
            if item.version and item.version != version:
                raise _conflict(
                    f"addons.{item.name}.version",
                    f"{item.name} runs {engine} {version}: a major version is not changed in place",
                )
            steps.append(AddonStep(UNCHANGED, item.name, note=f"{engine} {version}"))
        marker = addon.attached_var(item.name)
        wanted = [_label(project, app, ref) for ref in item.attach]
        for path in wanted:
            env = _env_at(view, path)
            attached = database is not None and env is not None and env.service.vars.get(marker) == database.meta.id
            steps.append(AddonStep(UNCHANGED if attached else ATTACH, item.name, path))
        if database is not None and file_app is not None:
            for env in view.envs():
                if env.app_id != file_app.meta.id or env.service.vars.get(marker) != database.meta.id:
                    continue
                path = env_path(view, env)
                if path not in wanted:
                    steps.append(AddonStep(DETACH, item.name, path, note="no longer in its attach list"))
    return steps


def _env_at(view: StateReader, path: str) -> pb.Environment | None:
    project_name, app_name, env_name = path.split("/")
    project = find_project(view, project_name)
    app = find_app(view, project.meta.id, app_name) if project is not None else None
    return find_env(view, app.meta.id, env_name) if app is not None else None


async def apply_addons(
    ctx: ActionContext, project: str, app: str, declared: list[DeclaredAddon], *, deploy: bool = True
) -> AddonsApplied:
    """Create the missing databases and attach/detach as :func:`plan_addons` says, one action each; a refusal
    names the file's key."""
    done = AddonsApplied()
    by_name = {item.name: item for item in declared}
    for step in plan_addons(ctx.view, project, app, declared):
        item = by_name[step.database]
        try:
            if step.action == CREATE:
                request = CreateAddon(
                    item.engine, item.name, project, item.version, item.archive_timeout, item.backup_interval
                )
                created = await create_addon(ctx, request)
                done.deployments.append(created.deployment_id)
            elif step.action == ATTACH:
                changed = await attach_addon(ctx, AttachAddon(item.name, step.env, deploy=deploy))
                done.deployments += [changed.deployment_id] if changed.deployment_id else []
            elif step.action == DETACH:
                changed = await detach_addon(ctx, AttachAddon(item.name, step.env, deploy=deploy))
                done.deployments += [changed.deployment_id] if changed.deployment_id else []
        except ActionRefused as exc:
            raise _field(item.name, exc) from None
        done.steps.append(step)
    return done
