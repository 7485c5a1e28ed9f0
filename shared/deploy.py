"""Creating, rolling back and canceling deployments: the library the CLI, the API and the tests call.

The orchestrator only consumes what this writes. Every operation is ONE fenced write decided on the
caller's view:

* a new deployment (with its release, and its build for a source deploy) is created in the same
  batch as an unchanged re-write of its environment, expecting the environment's revision. The
  environment is the per-env serialization point: of two concurrent deploys one commits, the other is
  refused, refreshes and decides again — so release versions (1 + the env's highest) are never
  duplicated and the blocking rule cannot be raced past. The orchestrator's promotion also writes the
  environment, so ``previous_release_id`` is always the active release at commit time.
* a cancel re-writes the deployment, expecting its revision. Before promotion it records the request
  (``error = "canceled by operator"`` on a non-terminal deployment; the orchestrator then fails it and
  removes its green set in one write); while DRAINING_OLD it moves ``drain_deadline`` to now, so the
  orchestrator completes the drain at once.

Refusals are operator-action refusals (:mod:`shared.actions.refusals`); validation errors name the
offending field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions import refusals
from shared.actions.refusals import ActionRefused, Conflicting, Invalid
from shared.clock import Clock, RealClock, stamp
from shared.deployments import is_terminal
from shared.ids import SAFE_ID_RULE, is_safe_id
from shared.records import new_meta
from shared.retry import Attempt, Decide, RetriesExhausted, commit_with_retry, decide_again
from shared.state.reader import StateReader
from shared.txn import Txn, Writer

CANCELED_BY_OPERATOR = "canceled by operator"
DEPLOYMENT_IN_PROGRESS = "a deployment is already in progress for this environment"
ENVIRONMENT_NOT_FOUND = "environment not found"
BUILD_NOT_FOUND = "build not found"
BUILD_HAS_NO_IMAGE = "build has not produced an image yet"
IMAGE_OR_BUILD_REQUIRED = "either image_ref or build_id is required"
NO_PREVIOUS_RELEASE = "no previous release to roll back to"
TARGET_NOT_IN_ENV = "target release not found in this environment"
DEPLOYMENT_NOT_FOUND = "deployment not found"

MAX_GIT_MESSAGE = 4096
"""A commit message is recorded up to this many characters (the release travels on every assignment read)."""
MAX_GIT_AUTHOR = 256

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_MAX_IMAGE_REF = 512

T = TypeVar("T")


class DeployError(ActionRefused):
    """A refused request. ``field``: the request field it is about ("" when none), ``problem``: what is
    wrong with it."""


class NotFound(DeployError, refusals.NotFound):
    pass


class FailedPrecondition(DeployError, Conflicting):
    """The state does not allow it now (a deployment under way, nothing to roll back to)."""


class InvalidArgument(DeployError, Invalid):
    def __init__(self, field: str, problem: str) -> None:
        Invalid.__init__(self, field, problem)


class Contended(DeployError, Conflicting):
    """The environment kept changing under us; nothing was written."""


def cancel_requested(d: pb.Deployment) -> bool:
    """An operator asked to cancel this not-yet-finished deployment."""
    return not is_terminal(d.phase) and d.error == CANCELED_BY_OPERATOR


def blocking_deployments(view: StateReader, env_id: str) -> list[pb.Deployment]:
    """Deployments that block a new one: not terminal and not already promoted (DRAINING_OLD)."""
    return [
        d for d in view.deployments(env_id) if not is_terminal(d.phase) and d.phase != pb.DEPLOYMENT_PHASE_DRAINING_OLD
    ]


def config_hash(spec: pb.ServiceSpec) -> str:
    """Fingerprint of the frozen service spec (copied verbatim onto assignments)."""
    return "sha256:" + hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()[:32]


ConfigEdit = Callable[[pb.Environment, Txn], None]
"""Changes an environment copy's configuration (``service.vars``/``secrets``, ``config_version`` bumped) and
adds the records that go with it (sealed secrets) to the transaction; raises to refuse."""

STAGE_HINT = "; use --no-deploy to stage the change for the next deploy"


@dataclass(frozen=True, slots=True)
class Reconfigured:
    environment: pb.Environment
    deployment: pb.Deployment | None = None
    release: pb.Release | None = None


@dataclass(frozen=True, slots=True)
class Created:
    deployment: pb.Deployment
    release: pb.Release
    build: pb.Build | None = None


def _check_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field, "is required")
    if not is_safe_id(value):
        raise InvalidArgument(field, f"must be {SAFE_ID_RULE}")


def _check_image_ref(value: str) -> None:
    if len(value) > _MAX_IMAGE_REF:
        raise InvalidArgument("image_ref", f"must be at most {_MAX_IMAGE_REF} characters")
    if any(c.isspace() for c in value):
        raise InvalidArgument("image_ref", "must not contain whitespace")


class Deployer:
    """Deployment operations on behalf of ``created_by``, through an (unfenced) writer and its view."""

    def __init__(self, writer: Writer, *, clock: Clock | None = None, created_by: str = "") -> None:
        self._writer = writer
        self._view = writer.view
        self._clock = clock or RealClock()
        self._created_by = created_by

    # ------------------------------------------------------------------ operations

    async def deploy(
        self, environment_id: str, *, image_ref: str = "", build_id: str = "", platforms: Sequence[str] = ()
    ) -> Created:
        """Deploy an image (``platforms``: what the image supports; empty = any node) or a built image."""
        _check_id("environment_id", environment_id)
        if image_ref and build_id:
            raise InvalidArgument("build_id", "give either image_ref or build_id, not both")
        if not image_ref and not build_id:
            raise InvalidArgument("image_ref", IMAGE_OR_BUILD_REQUIRED)
        if image_ref:
            _check_image_ref(image_ref)
        else:
            _check_id("build_id", build_id)

        def decide(env: pb.Environment) -> tuple[Txn, Created]:
            if build_id:
                build = self._view.build(build_id)
                if build is None:
                    raise NotFound(BUILD_NOT_FOUND, field="build_id")
                if build.status != pb.BUILD_STATUS_SUCCEEDED or not build.image_ref:
                    raise FailedPrecondition(BUILD_HAS_NO_IMAGE)
                release = self._new_release(env, build.image_ref, build.platforms, pb.RELEASE_SOURCE_KIND_BUILD)
                release.source.build_id = build_id
            else:
                release = self._new_release(env, image_ref, platforms, pb.RELEASE_SOURCE_KIND_IMAGE)
            deployment = self._new_deployment(env, release.meta.id)
            return self._txn(env, release, deployment), Created(deployment, release)

        return await self._create(environment_id, decide)

    async def deploy_image(self, environment_id: str, image_ref: str, *, platforms: Sequence[str] = ()) -> Created:
        return await self.deploy(environment_id, image_ref=image_ref, platforms=platforms)

    async def deploy_build(self, environment_id: str, build_id: str) -> Created:
        return await self.deploy(environment_id, build_id=build_id)

    async def deploy_source(
        self,
        environment_id: str,
        *,
        tarball_digest: str,
        build_type: int = pb.BUILD_TYPE_UNSPECIFIED,
        git_sha: str = "",
        git_branch: str = "",
        git_message: str = "",
        git_author: str = "",
        git_ref: str = "",
    ) -> Created:
        """Deploy uploaded source: a QUEUED build, a release without image, a deployment waiting on the build.
        ``git_*``: the commit the source is (recorded on the release; docs/git.md)."""
        _check_id("environment_id", environment_id)
        if not _DIGEST_RE.match(tarball_digest):
            raise InvalidArgument("tarball_digest", "must be 'sha256:' followed by 64 lowercase hex digits")
        if build_type not in pb.BuildType.values():
            raise InvalidArgument("build_type", f"unknown build type {build_type}")

        def decide(env: pb.Environment) -> tuple[Txn, Created]:
            now = self._clock.now()
            app = self._view.app(env.app_id)
            build = pb.Build(
                app_id=env.app_id,
                project_id=env.project_id,
                environment_id=env.meta.id,
                type=build_type,  # type: ignore[arg-type]
                status=pb.BUILD_STATUS_QUEUED,
                tarball_digest=tarball_digest,
                git_sha=git_sha,
                git_branch=git_branch,
            )
            new_meta(build.meta, now)
            if app is not None:
                build.platforms.extend(app.build.platforms)
            release = self._new_release(env, "", (), pb.RELEASE_SOURCE_KIND_UPLOAD)
            release.source.build_id = build.meta.id
            release.source.tarball_digest = tarball_digest
            release.source.git_sha = git_sha
            release.source.git_branch = git_branch
            release.source.git_message = git_message[:MAX_GIT_MESSAGE]
            release.source.git_author = git_author[:MAX_GIT_AUTHOR]
            release.source.git_ref = git_ref
            if git_sha:
                release.source.kind = pb.RELEASE_SOURCE_KIND_GIT
            deployment = self._new_deployment(env, release.meta.id, build_id=build.meta.id)
            txn = self._writer.txn("deploy-source").create(build)
            return self._txn(env, release, deployment, txn), Created(deployment, release, build)

        return await self._create(environment_id, decide)

    async def reconfigure(self, environment_id: str, edit: ConfigEdit, *, deploy: bool = True) -> Reconfigured:
        """Change an environment's configuration in ONE fenced write. With ``deploy`` and a live release, the
        write also makes a new release (the live image, the env's new spec) and its deployment, which rolls
        out red/green like any deploy; otherwise the change is staged for the next deploy."""
        _check_id("environment_id", environment_id)
        read_at = 0  # the env revision the last decision read

        def decide() -> Attempt[Reconfigured]:
            nonlocal read_at
            read_at = self._view.rev(K.env(environment_id))
            env = self._view.env(environment_id)
            if env is None:
                raise NotFound(ENVIRONMENT_NOT_FOUND)
            active = self._view.release(env.active_release_id) if env.active_release_id else None
            rolling = deploy and active is not None and bool(active.image_ref)
            if rolling and blocking_deployments(self._view, environment_id):
                raise FailedPrecondition(DEPLOYMENT_IN_PROGRESS + STAGE_HINT)
            txn = self._writer.txn("reconfigure")
            updated = pb.Environment()
            updated.CopyFrom(env)
            edit(updated, txn)
            stamp(updated.meta.updated_at, self._clock.now())
            if not rolling:
                return Attempt(txn.put(updated), Reconfigured(updated))
            assert active is not None
            release = self._new_release(updated, active.image_ref, active.platforms, active.source.kind)
            release.source.CopyFrom(active.source)
            deployment = self._new_deployment(updated, release.meta.id)
            return Attempt(self._txn(updated, release, deployment, txn), Reconfigured(updated, deployment, release))

        def landed(result: Reconfigured) -> bool:
            if self._view.rev(K.env(environment_id)) == read_at:
                return False
            current = self._view.env(environment_id)
            return current is not None and current.meta.updated_at == result.environment.meta.updated_at

        return await self._commit(decide, f"environment {environment_id}", landed)

    async def rollback(self, environment_id: str, *, to_release_id: str = "") -> pb.Deployment:
        """Roll back to ``to_release_id`` (a release of this env), by default the highest version below
        the active one that has an image. No release is minted."""
        _check_id("environment_id", environment_id)
        if to_release_id:
            _check_id("to_release_id", to_release_id)

        def decide(env: pb.Environment) -> tuple[Txn, Created]:
            target = self._rollback_target(env, to_release_id)
            deployment = self._new_deployment(env, target.meta.id, is_rollback=True)
            txn = self._writer.txn("rollback").create(deployment)
            txn.put(env)
            return txn, Created(deployment, target)

        created = await self._create(environment_id, decide)
        return created.deployment

    async def cancel(self, deployment_id: str) -> pb.Deployment:
        """Cancel a running deployment: before promotion it ends FAILED ("canceled by operator") with its
        green set removed and traffic untouched; while DRAINING_OLD it completes the drain now."""
        _check_id("deployment_id", deployment_id)

        def decide() -> Attempt[pb.Deployment]:
            current = self._view.deployment(deployment_id)
            if current is None:
                raise NotFound(DEPLOYMENT_NOT_FOUND)
            if is_terminal(current.phase):
                phase = pb.DeploymentPhase.Name(current.phase).removeprefix("DEPLOYMENT_PHASE_")
                raise FailedPrecondition(f"deployment already finished ({phase})")
            request = pb.Deployment()
            request.CopyFrom(current)
            now = self._clock.now()
            if current.phase == pb.DEPLOYMENT_PHASE_DRAINING_OLD:
                if current.HasField("drain_deadline") and current.drain_deadline.ToNanoseconds() <= now * 1e9:
                    return Attempt(None, current)
                stamp(request.drain_deadline, now)
            elif cancel_requested(current):
                return Attempt(None, current)
            else:
                request.error = CANCELED_BY_OPERATOR
            return Attempt(self._writer.txn("cancel").put(request), request)

        # After an unknown outcome the next decision finds the request recorded (or makes it again).
        return await self._commit(decide, f"deployment {deployment_id}", decide_again)

    # ------------------------------------------------------------------ building blocks

    async def _create(self, environment_id: str, decide: Callable[[pb.Environment], tuple[Txn, Created]]) -> Created:
        """Decide on the view and commit, fenced on the env; on a conflict wait for the view, decide again."""

        def attempt() -> Attempt[Created]:
            env = self._view.env(environment_id)
            if env is None:
                raise NotFound(ENVIRONMENT_NOT_FOUND)
            if blocking_deployments(self._view, environment_id):
                raise FailedPrecondition(DEPLOYMENT_IN_PROGRESS)
            txn, created = decide(env)
            return Attempt(txn, created)

        def landed(created: Created) -> bool:
            return self._view.deployment(created.deployment.meta.id) is not None

        return await self._commit(attempt, f"environment {environment_id}", landed)

    async def _commit(self, decide: Decide[T], contended: str, landed: Callable[[T], bool] | None = None) -> T:
        try:
            return await commit_with_retry(self._writer, decide, clock=self._clock, contended=contended, landed=landed)
        except RetriesExhausted as exc:
            raise Contended(str(exc)) from None

    def _txn(self, env: pb.Environment, release: pb.Release, deployment: pb.Deployment, txn: Txn | None = None) -> Txn:
        """Release and deployment, then the env re-write LAST: a view that sees the env's new revision has
        already applied the rest of the batch (messages arrive in stream order)."""
        txn = txn or self._writer.txn("deploy")
        txn.create(release).create(deployment)
        txn.put(env)
        return txn

    def _new_release(self, env: pb.Environment, image_ref: str, platforms: Sequence[str], kind: int) -> pb.Release:
        now = self._clock.now()
        version = 1 + max((r.version for r in self._view.releases(env.meta.id)), default=0)
        release = pb.Release(
            environment_id=env.meta.id,
            app_id=env.app_id,
            project_id=env.project_id,
            version=version,
            image_ref=image_ref,
            config_hash=config_hash(env.service),
        )
        new_meta(release.meta, now)
        release.service.CopyFrom(env.service)
        release.platforms.extend(platforms)
        release.source.kind = kind  # type: ignore[assignment]
        return release

    def _new_deployment(
        self, env: pb.Environment, release_id: str, *, build_id: str = "", is_rollback: bool = False
    ) -> pb.Deployment:
        now = self._clock.now()
        deployment = pb.Deployment(
            environment_id=env.meta.id,
            app_id=env.app_id,
            project_id=env.project_id,
            release_id=release_id,
            previous_release_id=env.active_release_id,
            phase=pb.DEPLOYMENT_PHASE_PENDING,
            is_rollback=is_rollback,
            build_id=build_id,
            created_by_user_id=self._created_by,
        )
        new_meta(deployment.meta, now)
        return deployment

    def _rollback_target(self, env: pb.Environment, to_release_id: str) -> pb.Release:
        if to_release_id:
            target = self._view.release(to_release_id)
            if target is None or target.environment_id != env.meta.id:
                raise NotFound(TARGET_NOT_IN_ENV, field="to_release_id")
            return target
        active = self._view.release(env.active_release_id) if env.active_release_id else None
        if active is None:
            raise FailedPrecondition(NO_PREVIOUS_RELEASE)
        older = [r for r in self._view.releases(env.meta.id) if r.version < active.version and r.image_ref]
        if not older:
            raise FailedPrecondition(NO_PREVIOUS_RELEASE)
        return max(older, key=lambda r: r.version)
