"""The jobs loop on a real NATS server with a fake clock: cron slots, concurrency policies, retries, missed
slots, lost nodes, cancels, one-off commands and one run per slot across leaders (docs/jobs.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from zattera.v1 import types_pb2 as pb

from services.scheduler.jobs import JobsLoop, evaluate_jobs, latest_due_slot
from shared import jobs as J
from shared import keys as K
from shared.lease import Lease
from shared.loop import LoopDeps
from shared.schedule import parse_schedule
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.txn import Conflict, Writer
from tests import factories as f
from tests.scheduler.conftest import Rig

T0 = 1_893_456_030.0  # 2030-01-01 00:00:30 UTC
SLOT1 = 1_893_456_300.0  # 00:05:00, the first slot of "*/5 * * * *" after T0
ENV = "e1"


@dataclass
class JobsRig:
    rig: Rig
    loop: JobsLoop

    async def pass_(self) -> None:
        await self.loop.pass_once()

    async def at(self, ts: float) -> None:
        self.rig.clock.set(ts)
        await self.pass_()

    def jobs(self, cron: str | None = "nightly") -> list[pb.Job]:
        return [j for j in self.rig.view.jobs(ENV) if cron is None or j.cron_name == cron]

    def job(self, job_id: str) -> pb.Job:
        job = self.rig.view.get(K.JOB, job_id)
        assert isinstance(job, pb.Job), job_id
        return job

    async def report(
        self, job: pb.Job, state: int, *, code: int | None = None, output: tuple[str, ...] = (), started: float = 0.0
    ) -> None:
        """What the agent of the job's node reports for its current attempt."""
        observed = pb.AssignmentObserved(state=state, output_tail=output)  # type: ignore[arg-type]
        if code is not None:
            observed.last_exit.code_known = True
            observed.last_exit.code = code
        if started:
            observed.started_at.FromNanoseconds(int(started * 1e9))
        writer = self.rig.writer
        await writer.commit(writer.txn().put(observed, key=K.observed(job.node_id, job.assignment_id)))


def cron_env(
    *,
    schedule: str = "*/5 * * * *",
    policy: pb.ConcurrencyPolicy.ValueType = pb.CONCURRENCY_POLICY_FORBID,
    max_retries: int = 0,
) -> pb.Environment:
    env = f.env(ENV, min_replicas=0, active_release_id="r1")
    cron = env.service.cron.add(
        name="nightly", schedule=schedule, command="python task.py", concurrency=policy, max_retries=max_retries
    )
    cron.since.FromNanoseconds(int(T0 * 1e9))
    cron.deadline.FromSeconds(600)
    return env


@pytest.fixture
async def jobs(rig: Rig) -> AsyncIterator[JobsRig]:
    rig.clock.set(T0)
    loop = JobsLoop(LoopDeps(rig.conn, rig.view, rig.clock))
    loop.writer = rig.writer
    await rig.put(f.node("n1"), f.release("r1", ENV))
    yield JobsRig(rig, loop)


def _assignment(jr: JobsRig, job: pb.Job) -> pb.Assignment:
    a = jr.rig.view.assignment(job.assignment_id)
    assert a is not None, job.assignment_id
    return a


# ---------------------------------------------------------------------------- pure slot arithmetic


@pytest.mark.parametrize(
    ("schedule", "after", "now", "due"),
    [
        ("*/5 * * * *", T0, T0 + 60, None),  # not due yet
        ("*/5 * * * *", T0, SLOT1, SLOT1),  # due on the dot
        ("*/5 * * * *", T0, SLOT1 + 3600 + 10, SLOT1 + 3600),  # after an outage: only the latest slot
        ("@every 90s", T0, T0 + 100, T0 + 90),
        ("@every 90s", T0, T0 + 400, T0 + 360),
        ("CRON_TZ=America/New_York 0 9 * * *", T0, T0 + 86400, 1_893_506_400.0),  # 14:00 UTC
    ],
)
def test_latest_due_slot(schedule: str, after: float, now: float, due: float | None) -> None:
    assert latest_due_slot(parse_schedule(schedule), after, now) == due


# ---------------------------------------------------------------------------- one slot, one run


async def test_a_due_slot_runs_once_placed_and_its_outcome_is_recorded(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env())
    await jobs.pass_()
    assert jobs.jobs() == []
    assert jobs.loop.seconds_until_due() == SLOT1 - T0
    await jobs.at(SLOT1 + 1)
    await jobs.pass_()
    [job] = jobs.jobs()
    assert job.meta.id == J.cron_job_id(ENV, "nightly", SLOT1)
    assert (job.status, job.node_id, job.attempt) == (J.PENDING, "n1", 1)
    a = _assignment(jobs, job)
    assert (a.job_id, a.job_command, a.release_id, a.desired) == (job.meta.id, "python task.py", "r1", 1)

    await jobs.report(job, pb.INSTANCE_STATE_RUNNING, started=SLOT1 + 2)
    await jobs.pass_()
    assert jobs.job(job.meta.id).status == J.RUNNING
    await jobs.report(job, pb.INSTANCE_STATE_STOPPED, code=0, output=("done", "42 rows"), started=SLOT1 + 2)
    await jobs.pass_()
    done = jobs.job(job.meta.id)
    assert (done.status, done.exit_code_known, done.exit_code) == (J.SUCCEEDED, True, 0)
    assert list(done.output_tail) == ["done", "42 rows"]
    assert done.started_at.seconds == int(SLOT1 + 2)
    assert jobs.rig.view.assignment(job.assignment_id) is None  # the agent cleans its instance up
    assert await jobs.rig.kinds() == ["job.created", "job.started", "job.succeeded"]


async def test_one_run_per_slot_when_two_leaders_decide_the_same_slot(jobs: JobsRig) -> None:
    """A deposed leader that decided from the same state as its successor: its create of the slot conflicts."""
    await jobs.rig.put(cron_env())
    jobs.rig.clock.set(SLOT1 + 1)
    first = evaluate_jobs(jobs.rig.view, SLOT1 + 1).writes
    second = evaluate_jobs(jobs.rig.view, SLOT1 + 1).writes
    await jobs.rig.writer.commit(first[0].txn(jobs.rig.writer))
    with pytest.raises(Conflict):
        await jobs.rig.writer.commit(second[0].txn(jobs.rig.writer))
    fresh = JobsLoop(LoopDeps(jobs.rig.conn, jobs.rig.view, jobs.rig.clock))
    fresh.writer = jobs.rig.writer
    await fresh.pass_once()  # the next leader sees the run: nothing new
    assert len(jobs.jobs()) == 1
    assert len([a for a in jobs.rig.view.assignments(ENV) if a.job_id]) == 1


async def test_a_leader_deposed_mid_slot_cannot_add_a_second_run(jobs: JobsRig) -> None:
    """Leader A decides the slot, loses its lease before committing (killed, partitioned); B takes over and
    runs the slot; A's late write is refused whole: one run, one assignment."""
    rig = jobs.rig
    await rig.put(cron_env())
    first = Lease(rig.conn, "jobs", "a", ttl=3)
    assert await first.try_acquire()
    rig.clock.set(SLOT1 + 1)
    stale = evaluate_jobs(rig.view, SLOT1 + 1).writes
    await rig.conn.js.publish(STATE_PREFIX + first.key, b"", headers={"KV-Operation": "DEL"}, stream=STATE_STREAM)
    second = Lease(rig.conn, "jobs", "b", ttl=3)
    assert await second.try_acquire()
    successor = JobsLoop(LoopDeps(rig.conn, rig.view, rig.clock))
    successor.writer = Writer(rig.conn, rig.view, lease=second)
    await successor.pass_once()
    deposed = Writer(rig.conn, rig.view, lease=first)
    with pytest.raises(Conflict):  # Deposed is a Conflict
        await deposed.commit(stale[0].txn(deposed))
    assert [j.meta.id for j in jobs.jobs()] == [J.cron_job_id(ENV, "nightly", SLOT1)]
    assert len([a for a in rig.view.assignments(ENV) if a.job_id]) == 1


# ---------------------------------------------------------------------------- concurrency policies


async def running_first_slot(jobs: JobsRig, policy: pb.ConcurrencyPolicy.ValueType) -> pb.Job:
    """The entry with ``policy``, its first slot's run placed and reported running."""
    await jobs.rig.put(cron_env(policy=policy))
    await jobs.at(SLOT1)
    [first] = jobs.jobs()
    await jobs.report(first, pb.INSTANCE_STATE_RUNNING)
    return first


async def test_forbid_skips_a_slot_while_the_previous_run_goes_on(jobs: JobsRig) -> None:
    first = await running_first_slot(jobs, pb.CONCURRENCY_POLICY_FORBID)
    await jobs.at(SLOT1 + 300)
    statuses = {j.meta.id: j.status for j in jobs.jobs()}
    assert statuses == {first.meta.id: J.RUNNING, J.cron_job_id(ENV, "nightly", SLOT1 + 300): J.SKIPPED}
    assert len([a for a in jobs.rig.view.assignments(ENV) if a.job_id]) == 1


async def test_replace_stops_the_previous_run(jobs: JobsRig) -> None:
    first = await running_first_slot(jobs, pb.CONCURRENCY_POLICY_REPLACE)
    await jobs.at(SLOT1 + 300)
    assert jobs.job(first.meta.id).cancel_requested
    assert _assignment(jobs, first).desired == pb.ASSIGNMENT_DESIRED_STOP
    second = jobs.job(J.cron_job_id(ENV, "nightly", SLOT1 + 300))
    assert second.status == J.PENDING and second.assignment_id
    await jobs.report(first, pb.INSTANCE_STATE_STOPPED)
    await jobs.pass_()
    assert jobs.job(first.meta.id).status == J.CANCELED
    assert jobs.rig.view.assignment(first.assignment_id) is None


async def test_replace_when_the_previous_run_is_being_canceled_already(jobs: JobsRig) -> None:
    first = await running_first_slot(jobs, pb.CONCURRENCY_POLICY_REPLACE)
    canceling = pb.Job()
    canceling.CopyFrom(jobs.job(first.meta.id))
    canceling.cancel_requested = True
    await jobs.rig.put(canceling)
    await jobs.at(SLOT1 + 300)  # the cancel and the next slot in one pass
    assert _assignment(jobs, first).desired == pb.ASSIGNMENT_DESIRED_STOP
    assert jobs.job(J.cron_job_id(ENV, "nightly", SLOT1 + 300)).assignment_id


async def test_allow_overlaps(jobs: JobsRig) -> None:
    await running_first_slot(jobs, pb.CONCURRENCY_POLICY_ALLOW)
    await jobs.at(SLOT1 + 300)
    assert sorted(j.status for j in jobs.jobs()) == [J.PENDING, J.RUNNING]
    assert len([a for a in jobs.rig.view.assignments(ENV) if a.job_id and a.desired == 1]) == 2


# ---------------------------------------------------------------------------- failures


async def test_a_failed_run_is_retried_up_to_max_retries(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env(max_retries=2))
    await jobs.at(SLOT1)
    job_id = jobs.jobs()[0].meta.id
    attempts = []
    for _ in range(3):
        job = jobs.job(job_id)
        attempts.append(job.assignment_id)
        await jobs.report(job, pb.INSTANCE_STATE_FAILED, code=3, output=("boom",))
        await jobs.pass_()
    final = jobs.job(job_id)
    assert (final.status, final.attempt, final.exit_code, list(final.output_tail)) == (J.FAILED, 3, 3, ["boom"])
    assert attempts == [f"{job_id}-1", f"{job_id}-2", f"{job_id}-3"]
    assert [a for a in jobs.rig.view.assignments(ENV) if a.job_id] == []
    assert (await jobs.rig.kinds()).count("job.retrying") == 2


async def test_a_run_whose_node_dies_fails_never_lost(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env(max_retries=1), f.node("n2"))
    await jobs.at(SLOT1)
    [job] = jobs.jobs()
    await jobs.report(job, pb.INSTANCE_STATE_RUNNING)
    await jobs.rig.set_node(job.node_id, pb.NODE_STATUS_DOWN)
    await jobs.pass_()
    retried = jobs.job(job.meta.id)
    assert retried.attempt == 2 and retried.node_id not in ("", job.node_id)
    assert f"node {job.node_id} is down" in retried.message
    await jobs.rig.set_node(retried.node_id, pb.NODE_STATUS_DOWN)
    await jobs.pass_()
    failed = jobs.job(job.meta.id)
    assert (failed.status, failed.message) == (J.FAILED, f"node {retried.node_id} is down")


async def test_a_slot_missed_while_down_runs_once_within_its_deadline_else_is_missed(jobs: JobsRig) -> None:
    hour = 3600.0
    first_slot = T0 - 30 + hour  # 01:00
    await jobs.rig.put(cron_env(schedule="0 * * * *"))  # deadline 600 s
    await jobs.at(first_slot + 2 * hour + 300)  # three slots passed meanwhile: only the latest (03:00) runs
    [job] = jobs.jobs()
    assert (job.slot_at.seconds, job.status) == (int(first_slot + 2 * hour), J.PENDING)
    await jobs.report(job, pb.INSTANCE_STATE_STOPPED, code=0)
    await jobs.pass_()
    await jobs.at(first_slot + 3 * hour + 601)  # 04:00 comes back 601 s late
    missed = jobs.job(J.cron_job_id(ENV, "nightly", first_slot + 3 * hour))
    assert missed.status == J.MISSED and not missed.assignment_id
    assert "job.missed" in await jobs.rig.kinds()


async def test_a_retry_after_a_long_run_is_not_refused_by_the_start_deadline(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env(max_retries=1))  # deadline 600 s
    await jobs.at(SLOT1)
    [job] = jobs.jobs()
    await jobs.report(job, pb.INSTANCE_STATE_RUNNING)
    await jobs.at(SLOT1 + 5000)  # ran for longer than the deadline, then failed
    await jobs.report(jobs.job(job.meta.id), pb.INSTANCE_STATE_FAILED, code=1)
    await jobs.pass_()
    retried = jobs.job(job.meta.id)
    assert (retried.status, retried.attempt, retried.node_id) == (J.PENDING, 2, "n1")


async def test_a_placed_run_that_never_starts_fails_at_its_deadline(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env())
    await jobs.at(SLOT1)
    [job] = jobs.jobs()
    await jobs.report(job, pb.INSTANCE_STATE_PENDING)
    await jobs.at(SLOT1 + 601)
    failed = jobs.job(job.meta.id)
    assert failed.status == J.FAILED and "not started within its deadline" in failed.message
    assert jobs.rig.view.assignment(job.assignment_id) is None


async def test_the_jobs_of_a_deleted_env_go(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env())
    await jobs.at(SLOT1)
    assert len(jobs.jobs()) == 1
    await jobs.rig.delete(K.env(ENV))
    await jobs.pass_()
    assert jobs.rig.view.jobs() == []


async def test_no_node_fits_stays_pending_with_the_reason_then_fails_at_the_deadline(jobs: JobsRig) -> None:
    env = cron_env()
    env.service.cron[0].resources.memory_mb = 1_000_000
    await jobs.rig.put(env)
    await jobs.at(SLOT1)
    [job] = jobs.jobs()
    assert job.status == J.PENDING and not job.assignment_id and job.message.startswith("waiting for a node")
    await jobs.at(SLOT1 + 601)
    assert jobs.job(job.meta.id).status == J.FAILED


# ---------------------------------------------------------------------------- one-off commands, cancel, history


async def test_one_off_job_is_placed_and_cancel_stops_it(jobs: JobsRig) -> None:
    env = f.env(ENV, min_replicas=0, active_release_id="r1")
    await jobs.rig.put(env)
    job = J.one_off_job(env, "python manage.py migrate", now=T0)
    await jobs.rig.writer.commit(jobs.rig.writer.txn().create(job))
    await jobs.pass_()
    placed = jobs.job(job.meta.id)
    assert _assignment(jobs, placed).job_command == "python manage.py migrate"
    canceling = pb.Job()
    canceling.CopyFrom(placed)
    canceling.cancel_requested = True
    await jobs.rig.put(canceling)
    await jobs.pass_()
    assert _assignment(jobs, placed).desired == pb.ASSIGNMENT_DESIRED_STOP
    await jobs.report(placed, pb.INSTANCE_STATE_STOPPED)
    await jobs.pass_()
    assert jobs.job(job.meta.id).status == J.CANCELED


async def test_history_is_bounded_per_entry(jobs: JobsRig) -> None:
    await jobs.rig.put(cron_env(schedule="@every 60s"))
    for minute in range(1, J.HISTORY_PER_ENTRY + 4):
        await jobs.at(T0 + 60 * minute)
        [active] = [j for j in jobs.jobs() if J.is_active(j)]
        await jobs.report(active, pb.INSTANCE_STATE_STOPPED, code=0)
        await jobs.pass_()
    kept = jobs.jobs()
    assert len(kept) == J.HISTORY_PER_ENTRY
    assert max(j.slot_at.seconds for j in kept) == int(T0 + 60 * (J.HISTORY_PER_ENTRY + 3))
