"""The jobs loop (lease ``jobs``): cron slots and one-off commands become job runs (docs/jobs.md).

Each pass decides purely from the view (:func:`evaluate_jobs`) and commits one fenced write per cron entry
and per one-off job:

* **cron slots.** For each entry of an env's ``service.cron`` (an env with an active release), the first
  slot after the entry's baseline (its ``since``, or the newest slot it has a record of) is due once the
  clock reaches it. After an outage only the latest due slot is considered: it runs when it is at most
  ``deadline`` late, else it is recorded MISSED. The run's id is derived from (env, entry, slot): a
  second leader creating the same slot conflicts, so a slot runs once across failovers.
* **concurrency.** While a previous run of the entry is active, FORBID records the slot SKIPPED, REPLACE
  cancels the previous run and starts the new one, ALLOW starts it beside.
* **runs.** A PENDING job is placed like a replica (``place``, with the entry's resources when it sets
  them) as an assignment with ``job_id`` and ``job_command``; it stays PENDING with the reason when no
  node fits, and FAILED once its deadline passed. The agent runs it once and reports its end; the loop
  records exit code, times and output tail on the job, deletes the assignment and, after a failure,
  starts the next attempt while ``max_retries`` allows. An attempt whose node is down or whose assignment
  vanished fails the same way: a run is never lost silently.
* **cancel.** ``cancel_requested`` stops the assignment; the job is CANCELED once its process stopped.
* **history.** Finished runs beyond :data:`shared.jobs.HISTORY_PER_ENTRY` per entry (per env for one-off
  commands) are deleted, never the newest record of an entry (its baseline). Jobs of a deleted env go.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from croniter import croniter
from zattera.v1 import types_pb2 as pb

from services.scheduler.decisions import event
from shared import jobs as J
from shared import keys as K
from shared.clock import from_timestamp as seconds
from shared.clock import stamp
from shared.decision import Decision
from shared.events import INFO, WARNING
from shared.loop import LeaderLoop, LoopDeps
from shared.placement.placement import PlacementIndex
from shared.placement.replicas import new_assignment, node_is_down, stopped
from shared.records import new_meta
from shared.schedule import Schedule, ScheduleError, parse_schedule
from shared.settings import DEFAULTS
from shared.state.reader import StateReader
from shared.state.tables import reservation

log = logging.getLogger(__name__)

RUN = pb.ASSIGNMENT_DESIRED_RUN
WAITING = "waiting for a node"
_ENDED = (pb.INSTANCE_STATE_STOPPED, pb.INSTANCE_STATE_FAILED)
_STARTED = (pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY)
_FINISHED_EVENTS = {
    J.SUCCEEDED: ("job.succeeded", INFO),
    J.FAILED: ("job.failed", WARNING),
    J.CANCELED: ("job.canceled", INFO),
    J.MISSED: ("job.missed", WARNING),
    J.SKIPPED: ("job.skipped", WARNING),
}


def _copy(job: pb.Job, now: float) -> pb.Job:
    out = pb.Job()
    out.CopyFrom(job)
    stamp(out.meta.updated_at, now)
    return out


@functools.lru_cache(maxsize=65536)
def next_slot(schedule: Schedule, after: float) -> float | None:
    """``schedule.next_after`` remembered: an entry's baseline moves once per run, and a croniter
    evaluation costs ~0.3 ms, too much to repeat for 1,000 entries on every pass."""
    return schedule.next_after(after)


def latest_due_slot(schedule: Schedule, after: float, now: float) -> float | None:
    """The newest slot in ``(after, now]`` (None: none due yet). Slots skipped before it are not run."""
    first = next_slot(schedule, after)
    if first is None or first > now:
        return None
    following = next_slot(schedule, first)
    if following is None or following > now:
        return first
    if schedule.every:
        base = float(int(after))
        return base + schedule.every * ((now - base) // schedule.every)
    newest: datetime = croniter(schedule.cron, datetime.fromtimestamp(int(now) + 1, schedule.zone)).get_prev(datetime)
    return max(first, newest.timestamp())


def job_label(job: pb.Job) -> str:
    if job.deployment_id:
        return f"release command of deployment {job.deployment_id}"
    return f"cron entry {job.cron_name}" if job.cron_name else "one-off command"


@dataclass
class JobsPass:
    """The writes of one pass and the soonest future slot (to wake for it before the tick)."""

    writes: list[Decision] = field(default_factory=list)
    next_slot: float | None = None


class _Decider:
    """One pass's decisions; every change of an entry or a one-off job goes into that one's :class:`Decision`."""

    def __init__(self, view: StateReader, now: float) -> None:
        self.view = view
        self.now = now
        self.index = PlacementIndex(view)
        self.result = JobsPass()

    # ------------------------------------------------------------------ the pass

    def evaluate(self) -> JobsPass:
        by_env: dict[str, list[pb.Job]] = defaultdict(list)
        for job in self.view.jobs():
            by_env[job.environment_id].append(job)
        for env_id, jobs in sorted(by_env.items()):
            if self.view.env(env_id) is None:  # its assignments are reaped as orphans
                self._add(Decision(f"jobs:{env_id}:gone", deletes=[K.job(j.meta.id) for j in jobs]))
        for env in self.view.envs():
            self._env(env, by_env.get(env.meta.id, []))
        return self.result

    def _add(self, writes: Decision) -> None:
        if writes:
            self.result.writes.append(writes)

    def _env(self, env: pb.Environment, jobs: list[pb.Job]) -> None:
        by_entry: dict[str, list[pb.Job]] = defaultdict(list)
        for job in jobs:
            by_entry[job.cron_name].append(job)
        one_offs = by_entry.pop("", [])
        for job in one_offs:
            writes = Decision(f"job:{job.meta.id}")
            if J.is_active(job):
                self._advance(env, job, writes)
            self._add(writes)
        self._add(self._history(f"jobs:{env.meta.id}:history", one_offs))
        entries = {entry.name: entry for entry in env.service.cron}
        for name in sorted(set(entries) | set(by_entry)):
            writes = Decision(f"cron:{env.meta.id}:{name}")
            runs = [self._advance(env, job, writes) if J.is_active(job) else job for job in by_entry.get(name, [])]
            entry = entries.get(name)
            if entry is not None and env.active_release_id:
                try:
                    self._slot(env, entry, runs, writes)
                except (ValueError, OverflowError, OSError) as exc:  # a time no calendar holds: skip, not stall
                    log.warning("env %s: cron entry %s skipped: %s", env.meta.id, name, exc)
            touched = {K.job(m.meta.id) for m in writes.puts if isinstance(m, pb.Job)}
            writes.deletes.extend(key for key in self._history("", runs).deletes if key not in touched)
            self._add(writes)

    # ------------------------------------------------------------------ cron slots

    def _slot(self, env: pb.Environment, entry: pb.CronSpec, runs: list[pb.Job], writes: Decision) -> None:
        try:
            schedule = parse_schedule(entry.schedule)
        except ScheduleError:
            return  # apply validated it; a schedule this version cannot read never fires
        since = entry.since if entry.HasField("since") else env.meta.created_at
        baseline = max([seconds(since), *(seconds(j.slot_at) for j in runs)])
        slot = latest_due_slot(schedule, baseline, self.now)
        if slot is None:
            upcoming = next_slot(schedule, baseline)
            if upcoming is not None:
                next_slot(schedule, upcoming)  # computed now, off the slot's critical path
                if self.result.next_slot is None or upcoming < self.result.next_slot:
                    self.result.next_slot = upcoming
            return
        job = self._cron_job(env, entry, slot)
        active = [j for j in runs if J.is_active(j)]
        if self._late(job):
            late = self.now - slot
            self._finish(env, job, J.MISSED, f"not started within its deadline ({late:.0f}s late)", writes)
        elif active and entry.concurrency in (pb.CONCURRENCY_POLICY_FORBID, pb.CONCURRENCY_POLICY_UNSPECIFIED):
            self._finish(env, job, J.SKIPPED, f"run {active[0].meta.id} still active (concurrency forbid)", writes)
        else:
            if entry.concurrency == pb.CONCURRENCY_POLICY_REPLACE:
                for previous in active:
                    self._cancel(previous, f"replaced by the run of slot {int(slot)}", writes)
            writes.events.append(self._event(env, job, "job.created", f"{self._describe(job)} created", INFO))
            self._place(env, job, writes)
        writes.creates.append(job)

    def _cron_job(self, env: pb.Environment, entry: pb.CronSpec, slot: float) -> pb.Job:
        job = pb.Job(
            project_id=env.project_id,
            app_id=env.app_id,
            environment_id=env.meta.id,
            cron_name=entry.name,
            command=entry.command,
            release_id=env.active_release_id,
            status=J.PENDING,
            attempt=1,
            max_retries=entry.max_retries,
        )
        new_meta(job.meta, self.now, J.cron_job_id(env.meta.id, entry.name, slot))
        stamp(job.slot_at, slot)
        if entry.HasField("deadline"):
            job.deadline.CopyFrom(entry.deadline)
        else:
            job.deadline.FromSeconds(int(J.DEFAULT_DEADLINE))
        if entry.HasField("resources"):
            job.resources.CopyFrom(entry.resources)
        return job

    def _cancel(self, job: pb.Job, why: str, writes: Decision) -> None:
        """Ask ``job`` (already a copy in ``writes``, or from the view) to stop."""
        if job.cancel_requested:
            return  # asked already: this pass's advance stops its assignment
        updated = next((w for w in writes.puts if isinstance(w, pb.Job) and w.meta.id == job.meta.id), None)
        if updated is None:
            updated = _copy(job, self.now)
            writes.puts.append(updated)
        updated.cancel_requested = True
        updated.message = why
        a = self.view.assignment(updated.assignment_id) if updated.assignment_id else None
        if a is not None and a.desired == RUN:
            writes.puts.append(stopped(a, now=self.now))

    # ------------------------------------------------------------------ one run's progress

    def _advance(self, env: pb.Environment, job: pb.Job, writes: Decision) -> pb.Job:
        """The job's next state (its copy is written when it changes); returns what the pass sees of it."""
        a = self.view.assignment(job.assignment_id) if job.assignment_id else None
        if job.cancel_requested:
            if a is not None and a.desired == RUN:
                writes.puts.append(stopped(a, now=self.now))
                return job
            if a is None or a.observed.state in _ENDED or node_is_down(self.view, a.node_id):
                updated = _copy(job, self.now)
                self._record_end(updated, a)
                self._finish(env, updated, J.CANCELED, job.message or "canceled", writes, assignment=a)
                writes.puts.append(updated)
                return updated
            return job
        if not job.assignment_id:
            updated = _copy(job, self.now)
            self._place(env, updated, writes)
            if _changed(job, updated):
                writes.puts.append(updated)
                return updated
            return job
        if a is None:
            return self._attempt_failed(env, job, None, "its assignment vanished", writes)
        if node_is_down(self.view, a.node_id):
            return self._attempt_failed(env, job, a, f"node {a.node_id} is down", writes)
        observed = a.observed
        if observed.state in _ENDED:
            exit_ok = observed.state == pb.INSTANCE_STATE_STOPPED and observed.last_exit.code_known
            if exit_ok and observed.last_exit.code == 0:
                updated = _copy(job, self.now)
                self._record_end(updated, a)
                self._finish(env, updated, J.SUCCEEDED, "exit code 0", writes, assignment=a)
                writes.puts.append(updated)
                return updated
            stopped_by_us = a.desired != RUN  # a drain of its node stopped it
            why = f"stopped on node {a.node_id} (drained)" if stopped_by_us else observed.message or "failed"
            return self._attempt_failed(env, job, a, why, writes)
        if job.status == J.PENDING and observed.state not in _STARTED and self._late(job):
            return self._attempt_failed(env, job, a, f"not started within its deadline ({observed.message})", writes)
        if observed.state in _STARTED and job.status == J.PENDING:
            updated = _copy(job, self.now)
            updated.status = J.RUNNING
            updated.message = ""
            if observed.HasField("started_at"):
                updated.started_at.CopyFrom(observed.started_at)
            else:
                stamp(updated.started_at, self.now)
            writes.events.append(self._event(env, updated, "job.started", f"{self._describe(updated)} started", INFO))
            writes.puts.append(updated)
            return updated
        return job

    def _attempt_failed(
        self, env: pb.Environment, job: pb.Job, a: pb.Assignment | None, why: str, writes: Decision
    ) -> pb.Job:
        updated = _copy(job, self.now)
        self._record_end(updated, a)
        if a is not None:
            writes.deletes.append(K.assignment(a.node_id, a.meta.id))
        if job.attempt <= job.max_retries:
            message = f"attempt {job.attempt} failed: {why}; retrying"
            updated.attempt += 1
            updated.status = J.PENDING
            updated.node_id = updated.assignment_id = ""
            updated.message = message
            text = f"{self._describe(job)}: {message}"
            writes.events.append(self._event(env, updated, "job.retrying", text, WARNING))
            self._place(env, updated, writes)
        else:
            self._finish(env, updated, J.FAILED, why, writes)
        writes.puts.append(updated)
        return updated

    def _record_end(self, job: pb.Job, a: pb.Assignment | None) -> None:
        """The attempt's outcome from the agent's report (exit, start, output tail)."""
        stamp(job.finished_at, self.now)
        if a is None:
            return
        observed = a.observed
        job.exit_code_known = observed.last_exit.code_known
        job.exit_code = observed.last_exit.code if job.exit_code_known else 0
        if observed.HasField("started_at"):
            job.started_at.CopyFrom(observed.started_at)
        del job.output_tail[:]
        job.output_tail.extend(observed.output_tail[-J.OUTPUT_TAIL_LINES :])

    def _finish(
        self,
        env: pb.Environment,
        job: pb.Job,
        status: pb.JobStatus.ValueType,
        message: str,
        writes: Decision,
        *,
        assignment: pb.Assignment | None = None,
    ) -> None:
        job.status = status
        job.message = message
        stamp(job.finished_at, self.now)
        if assignment is not None:
            writes.deletes.append(K.assignment(assignment.node_id, assignment.meta.id))
        kind, severity = _FINISHED_EVENTS[status]
        text = f"{self._describe(job)} {J.status_name(status)}: {message}"
        writes.events.append(self._event(env, job, kind, text, severity))

    def _place(self, env: pb.Environment, job: pb.Job, writes: Decision) -> None:
        """Place a PENDING job's current attempt (the assignment goes into ``writes``), or say why not."""
        release_id = job.release_id or env.active_release_id
        release = self.view.release(release_id) if release_id else None
        if release is None:
            self._finish(env, job, J.FAILED, "the environment has no active release to run it with", writes)
            return
        job.release_id = release_id
        if self._late(job):
            self._finish(env, job, J.FAILED, f"not placed within its deadline: {job.message}", writes)
            return
        shaped = pb.Release()
        shaped.CopyFrom(release)
        if job.HasField("resources"):
            shaped.service.resources.CopyFrom(job.resources)
        picks, error = self.index.place(shaped, env.meta.id, 1)
        if not picks:
            job.message = f"{WAITING}: {error}"
            return
        node_id = picks[0]
        cpu, mem = reservation(shaped)
        self.index.reserve(node_id, env.meta.id, cpu, mem, replicas=0)
        a = new_assignment(env, release, node_id, now=self.now, assignment_id=f"{job.meta.id}-{job.attempt}")
        a.job_id = job.meta.id
        a.job_command = job.command
        writes.creates.append(a)
        job.node_id, job.assignment_id = node_id, a.meta.id
        if job.message.startswith(WAITING):
            job.message = ""

    def _late(self, job: pb.Job) -> bool:
        """Past the start deadline, counted from the slot (a retry: from its previous attempt's end)."""
        since = max(seconds(job.slot_at), seconds(job.finished_at))
        return self.now - since > job.deadline.ToNanoseconds() / 1e9

    # ------------------------------------------------------------------ history and events

    def _history(self, label: str, jobs: Iterable[pb.Job]) -> Decision:
        finished = sorted((j for j in jobs if not J.is_active(j)), key=lambda j: (seconds(j.slot_at), j.meta.id))
        # The newest record stays whatever its age: it is the entry's baseline.
        old = finished[: max(0, len(finished) - J.HISTORY_PER_ENTRY)]
        return Decision(label, deletes=[K.job(j.meta.id) for j in old])

    def _describe(self, job: pb.Job) -> str:
        return f"job {job.meta.id} ({job_label(job)}, attempt {job.attempt})"

    def _event(self, env: pb.Environment, job: pb.Job, kind: str, message: str, severity: str) -> pb.Event:
        ev = event(kind, message, self.now, severity=severity, env=env, node_id=job.node_id)
        ev.fields["job_id"] = job.meta.id
        ev.transition = f"{K.job(job.meta.id)}:{kind}:{job.attempt}"  # stored once, whichever leader sends it
        if job.cron_name:
            ev.fields["cron"] = job.cron_name
        return ev


def _changed(before: pb.Job, after: pb.Job) -> bool:
    return (before.status, before.assignment_id, before.message) != (after.status, after.assignment_id, after.message)


def evaluate_jobs(view: StateReader, now: float) -> JobsPass:
    """Every job write of this pass (see the module docstring); pure over the view."""
    return _Decider(view, now).evaluate()


class JobsLoop(LeaderLoop):
    name = "jobs"
    kinds = frozenset({K.ENV, K.RELEASE, K.NODE, K.ASSIGNMENT, K.OBSERVED, K.JOB})

    def __init__(self, deps: LoopDeps, *, tick: float = DEFAULTS.loop_tick) -> None:
        super().__init__(deps, tick=tick)
        self._next_slot: float | None = None

    def seconds_until_due(self) -> float | None:
        return None if self._next_slot is None else self._next_slot - self.clock.now()

    async def run_pass(self) -> None:
        assert self.writer is not None
        decided = evaluate_jobs(self.view, self.clock.now())
        self._next_slot = decided.next_slot
        await self.commit_decisions(decided.writes)
