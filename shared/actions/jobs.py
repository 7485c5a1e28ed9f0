"""One-off commands and job cancels (``zattera run``, ``zattera jobs cancel``, the console's cancel button).

``run_job`` writes a PENDING ``job.<id>``; the jobs loop places it on the env's active release and the
agent runs it once. ``cancel_job`` sets ``cancel_requested`` (the jobs loop and the agent stop the job); a
write that crossed one of the jobs loop's updates of the job is made again on the newer version.
"""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared import jobs as J
from shared import keys as K
from shared.actions.context import ActionContext, commit
from shared.actions.fields import EnvPath, EnvRef
from shared.actions.names import env_label, env_path, target_env
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.clock import stamp
from shared.ids import is_safe_id, unsafe_id
from shared.retry import Attempt, decide_again
from shared.state.reader import StateReader


@dataclass(frozen=True, slots=True)
class RunJob:
    env: EnvRef
    command: str
    """A shell command (at most 4,096 bytes)."""


@dataclass(frozen=True, slots=True)
class JobStarted:
    job_id: str
    env_id: str
    env: EnvPath


@dataclass(frozen=True, slots=True)
class CancelJob:
    job_id: str
    env_id: str = ""
    """When given, the job must be this environment's (the console acts within an env's page)."""


@dataclass(frozen=True, slots=True)
class JobCancelRequested:
    job_id: str


def find_job(view: StateReader, job_id: str, env_id: str = "") -> pb.Job:
    """The job ``job_id`` names (of ``env_id`` when given), else a refusal about the ``job_id`` field."""
    if not is_safe_id(job_id):
        raise Invalid("job_id", unsafe_id("job id", job_id), said="")
    job = view.get(K.JOB, job_id)
    if not isinstance(job, pb.Job) or (env_id and job.environment_id != env_id):
        if env_id:
            raise NotFound(f"job {job_id!r} not found in env {env_id}", field="job_id")
        raise NotFound(f"no job {job_id!r} (see `zattera jobs list`)", field="job_id")
    return job


async def run_job(ctx: ActionContext, request: RunJob) -> JobStarted:
    command = J.check_command(request.command)

    def attempt() -> Attempt[pb.Job]:
        env = target_env(ctx.view, request.env)
        if not env.active_release_id:
            path = env_path(ctx.view, env)
            raise Conflicting(f"{path} has no active release yet (`zattera deploy` first)", field="env")
        job = J.one_off_job(env, command, now=ctx.clock.now())
        return Attempt(ctx.writer.txn("run").create(job), job)

    job = await commit(ctx, attempt, contended=f"env {request.env}")
    return JobStarted(job.meta.id, job.environment_id, env_label(ctx.view, job.environment_id))


async def cancel_job(ctx: ActionContext, request: CancelJob) -> JobCancelRequested:
    """Refused when the job already ended; asked again it changes nothing."""
    job = find_job(ctx.view, request.job_id, request.env_id)
    if not J.is_active(job):
        raise Conflicting(f"job {job.meta.id} already ended ({J.status_name(job.status)})", field="job_id")
    await request_cancel(ctx, job.meta.id)
    return JobCancelRequested(job.meta.id)


async def request_cancel(ctx: ActionContext, job_id: str) -> None:
    """Record the cancel on the job (nothing to do once it ended or the cancel is recorded), as
    ``canceled by <actor>``."""

    def decide() -> Attempt[None]:
        current = ctx.view.get(K.JOB, job_id)
        if not isinstance(current, pb.Job) or not J.is_active(current) or current.cancel_requested:
            return Attempt(None, None)
        canceling = pb.Job()
        canceling.CopyFrom(current)
        canceling.cancel_requested = True
        canceling.message = f"canceled by {ctx.actor}"
        stamp(canceling.meta.updated_at, ctx.clock.now())
        return Attempt(ctx.writer.txn("jobs.cancel").put(canceling), None)

    await commit(
        ctx,
        decide,
        contended=f"job {job_id}",
        kept_changing=f"job {job_id}: the cancel kept crossing the job's updates; cancel it again",
        landed=decide_again,
    )
