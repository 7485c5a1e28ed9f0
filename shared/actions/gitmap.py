"""Which git branch deploys which env (``zattera git map BRANCH --env E``, ``zattera git unmap --env E``;
docs/git.md): ``Environment.git_branch``, written by one fenced write of the env. A branch may map to several
envs of an app (a push then deploys each); ``git_branch`` in zattera.toml sets the same field on apply."""

from __future__ import annotations

import re
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext, commit_edit
from shared.actions.fields import EnvPath
from shared.actions.names import env_path, find_app, find_project, target_env
from shared.actions.refusals import Invalid
from shared.clock import stamp
from shared.gitsource import branch_of, branch_problem
from shared.state.reader import StateReader

_ZERO_SHA = re.compile(r"^0+$")


@dataclass(frozen=True, slots=True)
class BranchMapped:
    env: EnvPath
    branch: str
    """"" when unmapped."""
    changed: bool


def mapped(env: pb.Environment, branch: str, now: float) -> pb.Environment | None:
    """The env with ``git_branch`` = ``branch`` (None: it already is). Pure."""
    if env.git_branch == branch:
        return None
    updated = pb.Environment()
    updated.CopyFrom(env)
    updated.git_branch = branch
    stamp(updated.meta.updated_at, now)
    return updated


async def map_branch(ctx: ActionContext, env: str, branch: str) -> BranchMapped:
    """Map ``branch`` ("" = none) to the env ``env`` (id or project/app/env)."""
    if branch and (problem := branch_problem(branch)):
        raise Invalid("BRANCH", problem, said="BRANCH")
    target = target_env(ctx.view, env)

    def edit() -> pb.Environment | None:
        current = target_env(ctx.view, target.meta.id)
        return mapped(current, branch, ctx.clock.now())

    written = await commit_edit(ctx, f"env {env}", edit)
    return BranchMapped(env_path(ctx.view, target), branch, written is not None)


@dataclass(frozen=True, slots=True)
class Decided:
    deploys: list[tuple[str, str, str]]
    """(sha, ref, env name) for each deploy to make, in order."""
    refusal: str = ""


def mapped_branches(view: StateReader, project: str, app: str) -> dict[str, list[str]]:
    """branch → the names of the app's envs it deploys."""
    found: dict[str, list[str]] = {}
    app_msg = app_named(view, project, app)
    if app_msg is None:
        return found
    for env in view.envs():
        if env.app_id == app_msg.meta.id and env.git_branch:
            found.setdefault(env.git_branch, []).append(env.name)
    return {branch: sorted(envs) for branch, envs in sorted(found.items())}


def describe_mapping(mapping: dict[str, list[str]]) -> str:
    return ", ".join(f"{b} → {', '.join(envs)}" for b, envs in mapping.items()) or "none"


def decide_updates(view: StateReader, project: str, app: str, updates: list[tuple[str, ...]]) -> Decided:
    """What a push's updates (old sha, new sha, ref) deploy, or why the whole push is refused (a deleted
    ref, a ref that is not a branch, a branch mapped to no env). Pure over the view."""
    mapping = mapped_branches(view, project, app)
    deploys: list[tuple[str, str, str]] = []
    for _old, new, ref in updates:
        if _ZERO_SHA.match(new):
            return Decided([], f"zattera: refused: deleting {ref} is not allowed")
        if not ref.startswith("refs/heads/"):
            return Decided([], f"zattera: refused: {ref} is not a branch (push a branch: git push zattera main)")
        branch = branch_of(ref)
        envs = mapping.get(branch)
        if not envs:
            hint = "map one with `zattera git map BRANCH --env E` or git_branch in zattera.toml"
            return Decided(
                [],
                f"zattera: refused: branch {branch!r} deploys to no env of {project}/{app}; "
                f"mapped branches: {describe_mapping(mapping)} ({hint})",
            )
        deploys.extend((new, ref, env) for env in envs)
    return Decided(deploys)


def app_named(view: StateReader, project: str, app: str) -> pb.App | None:
    p = find_project(view, project)
    return find_app(view, p.meta.id, app) if p is not None else None
