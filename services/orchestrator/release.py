"""The release phase (docs/git.md): an env's ``release_command`` runs once per deploy, with the new release
(its image, config and secrets), after the build and before any green replica is placed.

The command runs as a job (``job.<deployment id>-release``, ``Job.deployment_id`` set): the jobs loop places
it on the NEW release, the agent runs it to its end and ships its output to the env's log stream, the
jobs loop records the outcome. The orchestrator only decides, each step ONE fenced write:

    (build done / PENDING) -> RELEASING -(no other release command of the env running)-> job created
    RELEASING -(job SUCCEEDED)-> PLACING (STOPPING_OLD for a stateful env)
    RELEASING -(job FAILED / CANCELED / MISSED, or the phase timed out)-> FAILED, nothing promoted

* The job's id is derived from the deployment: a second leader creating it conflicts, so it runs once.
* Two deploys of one env never run it at once: a deployment creates its job only when no other release
  job of the env is still pending or running (a superseded deployment's canceled job must have stopped).
* A deployment that ends (superseded, canceled, timed out, env gone) while its job is active cancels the
  job in the same write (:func:`cancel_with`).
* Rollbacks do not run it (they return to a release whose command already ran).
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, abort, copy_of, move, stay
from shared import jobs as J
from shared import keys as K
from shared.clock import stamp
from shared.decision import Decision
from shared.deployments import is_terminal
from shared.records import new_meta
from shared.state.reader import StateReader

RELEASING = pb.DEPLOYMENT_PHASE_RELEASING
RELEASE_FAILED = "release command failed"
RELEASE_TAIL_LINES = 10
"""The last lines of the release command's output a failure reason quotes."""
RELEASE_TAIL_CHARS = 1500


def release_job_id(deployment_id: str) -> str:
    return f"{deployment_id}-release"


def needs_release_phase(d: pb.Deployment, release: pb.Release) -> bool:
    return bool(release.service.release_command.strip()) and not d.is_rollback


def job_of(view: StateReader, job_id: str) -> pb.Job | None:
    job = view.get(K.JOB, job_id) if job_id else None
    return job if isinstance(job, pb.Job) else None


def other_release_running(view: StateReader, d: pb.Deployment) -> pb.Job | None:
    """Another deployment's release command of the same env that is still pending or running."""
    for job in view.jobs(d.environment_id):
        if job.deployment_id and job.deployment_id != d.meta.id and J.is_active(job):
            return job
    return None


def new_release_job(d: pb.Deployment, release: pb.Release, now: float, timers: Timers) -> pb.Job:
    job = pb.Job(
        project_id=d.project_id,
        app_id=d.app_id,
        environment_id=d.environment_id,
        command=release.service.release_command,
        release_id=release.meta.id,
        status=J.PENDING,
        attempt=1,
        max_retries=0,
        deployment_id=d.meta.id,
    )
    new_meta(job.meta, now, release_job_id(d.meta.id))
    stamp(job.slot_at, now)
    job.deadline.FromNanoseconds(int(timers.releasing_timeout * 1e9))
    return job


def failure_reason(job: pb.Job) -> str:
    """``release command failed (exit 3): <message>; last lines: …`` (the tail bounded)."""
    head = f"{RELEASE_FAILED} ({'exit ' + str(job.exit_code) if job.exit_code_known else J.status_name(job.status)})"
    if job.message and not job.message.startswith("exit code"):
        head += f": {job.message}"
    tail = [line for line in job.output_tail if line.strip()][-RELEASE_TAIL_LINES:]
    if not tail:
        return head
    text = " | ".join(tail)
    if len(text) > RELEASE_TAIL_CHARS:
        text = "…" + text[-RELEASE_TAIL_CHARS:]
    return f"{head}; last lines: {text}"


def releasing(
    view: StateReader, d: pb.Deployment, release: pb.Release, now: float, timers: Timers, *, next_phase: int
) -> Decision | None:
    """One step of a RELEASING deployment (None: wait for the job, or for another deploy's to stop)."""
    late = timers.overdue(d, now)
    job = job_of(view, d.release_job_id)
    if job is None:
        if late is not None:
            return abort(view, d, f"{late}: the release command did not start", now)
        if d.release_job_id:  # created, then deleted (history trimmed, or by hand): it cannot report
            return abort(view, d, f"{RELEASE_FAILED}: its job {d.release_job_id} vanished", now)
        if other_release_running(view, d) is not None:
            return None  # the jobs loop's write that ends it wakes us
        created = new_release_job(d, release, now, timers)
        t = stay(d, "release command created")
        assert isinstance(t.fence, pb.Deployment)
        t.fence.release_job_id = created.meta.id
        t.creates = [created]
        return t
    if job.status == J.SUCCEEDED:
        return move(d, next_phase, now)
    if not J.is_active(job):
        return abort(view, d, failure_reason(job), now)
    if late is not None:
        return abort(view, d, f"{late}: release command still {J.status_name(job.status)}", now)
    return None


def cancel_with(view: StateReader, before: pb.Deployment, t: Decision, now: float) -> None:
    """When ``t`` ends the deployment while its release command is pending or running, cancel the command
    in the same write (the jobs loop stops its process)."""
    after = t.fence
    if not isinstance(after, pb.Deployment) or not is_terminal(after.phase) or is_terminal(before.phase):
        return
    job = job_of(view, after.release_job_id)
    if job is None or not J.is_active(job) or job.cancel_requested:
        return
    canceled = copy_of(job)
    canceled.cancel_requested = True
    canceled.message = f"deployment {after.meta.id} ended: {after.error or 'superseded'}"[:500]
    stamp(canceled.meta.updated_at, now)
    t.puts.append(canceled)
