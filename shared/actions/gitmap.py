"""Which git branch deploys which env (``zattera git map BRANCH --env E``, ``zattera git unmap --env E``;
docs/git.md): ``Environment.git_branch``, written by one fenced write of the env. A branch may map to several
envs of an app (a push then deploys each); ``git_branch`` in zattera.toml sets the same field on apply."""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext, commit_edit
from shared.actions.names import env_path, target_env
from shared.actions.refusals import Invalid
from shared.clock import stamp
from shared.gitsource import branch_problem


@dataclass(frozen=True, slots=True)
class BranchMapped:
    env: str
    """``project/app/env``."""
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
