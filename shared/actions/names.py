"""Finding what an operator names: an environment by id or ``project/app/env``, a project or an app by name,
and the ``project/app/env`` path every message shows."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.fields import EnvPath, EnvRef
from shared.actions.refusals import NotFound
from shared.state.reader import StateReader


def find_project(view: StateReader, name: str) -> pb.Project | None:
    return next((p for p in view.all(K.PROJECT) if p.name == name), None)


def find_app(view: StateReader, project_id: str, name: str) -> pb.App | None:
    return next((a for a in view.all(K.APP) if a.project_id == project_id and a.name == name), None)


def find_env(view: StateReader, app_id: str, name: str) -> pb.Environment | None:
    return next((e for e in view.envs() if e.app_id == app_id and e.name == name), None)


def resolve_env(view: StateReader, ref: EnvRef) -> pb.Environment | None:
    """An environment by id or by ``project/app/env`` names."""
    env = view.env(ref)
    if env is not None:
        return env
    parts = ref.split("/")
    if len(parts) != 3:
        return None
    project = find_project(view, parts[0])
    app = find_app(view, project.meta.id, parts[1]) if project else None
    return find_env(view, app.meta.id, parts[2]) if app else None


def target_env(view: StateReader, ref: EnvRef) -> pb.Environment:
    """The environment ``ref`` names, else a :class:`NotFound` refusal about the ``env`` field."""
    env = resolve_env(view, ref)
    if env is None:
        raise NotFound(f"no environment {ref!r} (use an id or project/app/env)", field="env")
    return env


def resolve_app(view: StateReader, ref: str) -> pb.App | None:
    """An app by id or by ``project/app`` names."""
    found = view.app(ref)
    if found is not None:
        return found
    project_name, sep, app_name = ref.partition("/")
    project = find_project(view, project_name) if sep else None
    return find_app(view, project.meta.id, app_name) if project else None


def resolve_project(view: StateReader, ref: str) -> pb.Project | None:
    """A project by id or by name."""
    return view.project(ref) or find_project(view, ref)


def env_path(view: StateReader, env: pb.Environment) -> EnvPath:
    project = view.project(env.project_id)
    app = view.app(env.app_id)
    return f"{project.name if project else '?'}/{app.name if app else '?'}/{env.name}"


def env_label(view: StateReader, env_id: str) -> str:
    """``project/app/env`` of an environment id; the id itself when the environment is gone."""
    env = view.env(env_id)
    return env_path(view, env) if env is not None else env_id


def release_label(view: StateReader, release_id: str) -> str:
    """``v3``, as operators see releases everywhere; the id itself when the release is gone ("-" for none)."""
    release = view.release(release_id) if release_id else None
    return f"v{release.version}" if release is not None else release_id or "-"
