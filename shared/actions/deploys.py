"""Deploying, rolling back and canceling (``zattera deploy``, ``zattera rollback``, ``zattera deploy cancel``,
the console's rollback button): requests over :class:`shared.deploy.Deployer`, which makes each one ONE
fenced write decided on the caller's view. The orchestrator rolls the deployment out and announces it."""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext, commit
from shared.actions.fields import EnvPath, EnvRef
from shared.actions.names import env_path, target_env
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.canary import ABORT, PROMOTE
from shared.deploy import Created, InvalidArgument
from shared.retry import Attempt


@dataclass(frozen=True, slots=True)
class Deploy:
    """Exactly one of ``image_ref``, ``build_id`` or ``tarball_digest`` (uploaded source: built first)."""

    env: EnvRef
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
    env: EnvRef
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
    env: EnvPath
    build_id: str = ""


@dataclass(frozen=True, slots=True)
class CancelRequested:
    deployment_id: str
    phase: str
    """The deployment's phase when the cancel was recorded (PENDING, DRAINING_OLD, …)."""


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
    deployer = ctx.deployer()
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
    deployment = await ctx.deployer().rollback(env.meta.id, to_release_id=request.to_release_id)
    release = ctx.view.release(deployment.release_id)
    assert release is not None  # the target release was read to decide
    return _deployed(ctx, env, deployment, release)


async def cancel_deployment(ctx: ActionContext, request: CancelDeployment) -> CancelRequested:
    """Before promotion the deployment fails with its green set removed and traffic untouched; while
    DRAINING_OLD it completes the drain now."""
    deployment = await ctx.deployer().cancel(request.deployment_id)
    phase = pb.DeploymentPhase.Name(deployment.phase).removeprefix("DEPLOYMENT_PHASE_")
    return CancelRequested(deployment.meta.id, phase)


@dataclass(frozen=True, slots=True)
class CanaryDecision:
    """``zattera deploy promote ID`` / ``zattera deploy abort ID`` (issue 41, docs/deployments.md)."""

    deployment_id: str


@dataclass(frozen=True, slots=True)
class CanaryRequested:
    deployment_id: str
    requested: str
    """``promote`` or ``abort``: what the orchestrator does next (at once: it wakes on the write)."""
    step: int
    weight: int


async def promote_canary(ctx: ActionContext, request: CanaryDecision) -> CanaryRequested:
    """Skip the remaining steps of a canary: the orchestrator promotes the new release to all traffic."""
    return await _request_canary(ctx, request, PROMOTE)


async def abort_canary(ctx: ActionContext, request: CanaryDecision) -> CanaryRequested:
    """Abort a canary: its weight goes back to 0 and its replicas stop (``deployment.canary_aborted``)."""
    return await _request_canary(ctx, request, ABORT)


async def _request_canary(ctx: ActionContext, request: CanaryDecision, what: str) -> CanaryRequested:
    """ONE write of the deployment with the request recorded; the orchestrator's canary phase acts on it
    (fenced like every step: a step decided meanwhile refuses this write, which is then decided again)."""
    if not request.deployment_id.strip():
        raise Invalid("deployment_id", "must not be empty")

    def decide() -> Attempt[CanaryRequested]:
        current = ctx.view.deployment(request.deployment_id)
        if current is None:
            raise NotFound(f"no deployment {request.deployment_id!r}", field="deployment_id")
        if current.phase != pb.DEPLOYMENT_PHASE_CANARY:
            phase = pb.DeploymentPhase.Name(current.phase).removeprefix("DEPLOYMENT_PHASE_")
            raise Conflicting(f"deployment {request.deployment_id} is not in a canary step ({phase})")
        result = CanaryRequested(current.meta.id, what, current.canary.step, current.canary.weight)
        if current.canary.requested == what:
            return Attempt(None, result)
        if current.canary.requested:
            raise Conflicting(f"{current.canary.requested} already requested by {current.canary.requested_by}")
        asked = pb.Deployment()
        asked.CopyFrom(current)
        asked.canary.requested, asked.canary.requested_by = what, ctx.actor
        return Attempt(ctx.writer.txn(f"canary-{what}").put(asked), result)

    return await commit(ctx, decide, contended=f"deployment {request.deployment_id}")
