"""Deploying, rolling back and canceling (``zattera deploy``, ``zattera rollback``, ``zattera deploy cancel``,
the console's rollback button): requests over :class:`shared.deploy.Deployer`, which makes each one ONE
fenced write decided on the caller's view. The orchestrator rolls the deployment out and announces it."""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext
from shared.actions.names import env_path, target_env
from shared.deploy import Created, Deployer, InvalidArgument


@dataclass(frozen=True, slots=True)
class Deploy:
    """Exactly one of ``image_ref``, ``build_id`` or ``tarball_digest`` (uploaded source: built first)."""

    env: str
    """The environment: its id or ``project/app/env``."""
    image_ref: str = ""
    build_id: str = ""
    tarball_digest: str = ""
    commit: GitCommit | None = None
    """The git commit the uploaded source is (recorded on the release), when known."""


@dataclass(frozen=True, slots=True)
class GitCommit:
    """A commit's metadata as a release records it (docs/git.md)."""

    sha: str
    branch: str = ""
    ref: str = ""
    author: str = ""
    """``Name <email>``."""
    message: str = ""


@dataclass(frozen=True, slots=True)
class Rollback:
    env: str
    to_release_id: str = ""
    """"": the highest version below the active one that has an image."""


@dataclass(frozen=True, slots=True)
class CancelDeployment:
    deployment_id: str


@dataclass(frozen=True, slots=True)
class Deployed:
    deployment_id: str
    release_id: str
    release_version: int
    env_id: str
    env: str
    """``project/app/env``."""
    build_id: str = ""


@dataclass(frozen=True, slots=True)
class CancelRequested:
    deployment_id: str
    phase: str
    """The deployment's phase when the cancel was recorded (PENDING, DRAINING_OLD, …)."""


def _deployer(ctx: ActionContext) -> Deployer:
    return Deployer(ctx.writer, clock=ctx.clock, created_by=ctx.actor)


def _deployed(ctx: ActionContext, env: pb.Environment, deployment: pb.Deployment, release: pb.Release) -> Deployed:
    return Deployed(
        deployment.meta.id,
        release.meta.id,
        release.version,
        env.meta.id,
        env_path(ctx.view, env),
        deployment.build_id,
    )


async def deploy(ctx: ActionContext, request: Deploy) -> Deployed:
    env = target_env(ctx.view, request.env)
    deployer = _deployer(ctx)
    created: Created
    if request.tarball_digest and (request.image_ref or request.build_id):
        raise InvalidArgument("tarball_digest", "give source, an image or a build, not several")
    if request.tarball_digest:
        commit = request.commit or GitCommit("")
        created = await deployer.deploy_source(
            env.meta.id,
            tarball_digest=request.tarball_digest,
            git_sha=commit.sha,
            git_branch=commit.branch,
            git_ref=commit.ref,
            git_author=commit.author,
            git_message=commit.message,
        )
    else:
        created = await deployer.deploy(env.meta.id, image_ref=request.image_ref, build_id=request.build_id)
    return _deployed(ctx, env, created.deployment, created.release)


async def rollback(ctx: ActionContext, request: Rollback) -> Deployed:
    env = target_env(ctx.view, request.env)
    deployment = await _deployer(ctx).rollback(env.meta.id, to_release_id=request.to_release_id)
    release = ctx.view.release(deployment.release_id)
    assert release is not None  # the target release was read to decide
    return _deployed(ctx, env, deployment, release)


async def cancel_deployment(ctx: ActionContext, request: CancelDeployment) -> CancelRequested:
    """Before promotion the deployment fails with its green set removed and traffic untouched; while
    DRAINING_OLD it completes the drain now."""
    deployment = await _deployer(ctx).cancel(request.deployment_id)
    phase = pb.DeploymentPhase.Name(deployment.phase).removeprefix("DEPLOYMENT_PHASE_")
    return CancelRequested(deployment.meta.id, phase)
