"""Jobs (docs/jobs.md): what the CLI, the jobs loop and the agent agree on about a ``job.<id>`` record.

A job is one run of a cron entry's slot (``ServiceSpec.cron``) or one ``zattera run`` command. Its
assignment (``Assignment.job_id``) is run to completion by the node's agent, never restarted; the jobs loop
(``services/scheduler/jobs.py``) records the outcome on the job and deletes the assignment.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp
from zattera.v1 import types_pb2 as pb

from shared.actions.refusals import Invalid
from shared.clock import stamp
from shared.records import new_meta

MAX_COMMAND_BYTES = 4096
"""A job's shell command at most (UTF-8): it travels on the assignment every agent pass reads."""
MAX_RETRIES = 10
DEFAULT_DEADLINE = 3600.0
"""A slot (or a one-off command) that cannot start within this many seconds is MISSED (or FAILED)."""
HISTORY_PER_ENTRY = 20
"""Finished runs kept per cron entry (and per env for one-off commands); older ones are deleted."""
OUTPUT_TAIL_LINES = 20

PENDING = pb.JOB_STATUS_PENDING
RUNNING = pb.JOB_STATUS_RUNNING
SUCCEEDED = pb.JOB_STATUS_SUCCEEDED
FAILED = pb.JOB_STATUS_FAILED
CANCELED = pb.JOB_STATUS_CANCELED
MISSED = pb.JOB_STATUS_MISSED
SKIPPED = pb.JOB_STATUS_SKIPPED
ACTIVE_STATUSES = frozenset({PENDING, RUNNING})

POLICIES = {
    "forbid": pb.CONCURRENCY_POLICY_FORBID,
    "replace": pb.CONCURRENCY_POLICY_REPLACE,
    "allow": pb.CONCURRENCY_POLICY_ALLOW,
}


class CommandError(Invalid):
    """A job command the platform refuses (the message says why)."""

    def __init__(self, problem: str) -> None:
        super().__init__("command", problem, said="")


def check_command(command: str) -> str:
    """The command if it can run as a job, else :class:`CommandError`."""
    if not command.strip():
        raise CommandError("must not be empty")
    size = len(command.encode("utf-8"))
    if size > MAX_COMMAND_BYTES:
        raise CommandError(f"is {size} bytes, over the {MAX_COMMAND_BYTES}-byte limit")
    if "\x00" in command:
        raise CommandError("must not contain a NUL byte")
    return command


def is_active(job: pb.Job) -> bool:
    return job.status in ACTIVE_STATUSES


def status_name(status: int) -> str:
    return pb.JobStatus.Name(status).removeprefix("JOB_STATUS_").lower()  # type: ignore[arg-type]


def cron_job_id(env_id: str, cron_name: str, slot_at: float) -> str:
    """The one id of a cron slot's run: a second leader creating the same slot conflicts on it."""
    return f"{env_id}-{cron_name}-{int(slot_at)}"


def one_off_job(env: pb.Environment, command: str, *, now: float) -> pb.Job:
    """A PENDING ``zattera run`` job of ``env`` (the jobs loop places it on the env's active release)."""
    job = pb.Job(
        project_id=env.project_id,
        app_id=env.app_id,
        environment_id=env.meta.id,
        command=check_command(command),
        status=PENDING,
        attempt=1,
    )
    new_meta(job.meta, now)
    stamp(job.slot_at, now)
    job.deadline.FromSeconds(int(DEFAULT_DEADLINE))
    return job


def _seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def duration(job: pb.Job) -> str:
    """How long the run took ("-" until it started and finished)."""
    if not job.HasField("started_at") or not job.HasField("finished_at"):
        return "-"
    return f"{max(0.0, _seconds(job.finished_at) - _seconds(job.started_at)):.1f}s"


def exit_text(job: pb.Job) -> str:
    return str(job.exit_code) if job.exit_code_known else "-"


def newest_first(jobs: list[pb.Job]) -> list[pb.Job]:
    return sorted(jobs, key=lambda j: (_seconds(j.slot_at), j.meta.id), reverse=True)
