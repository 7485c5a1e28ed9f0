"""The release phase as pure decisions (services/orchestrator/release.py): the command's job is created once,
its outcome moves the deployment on or fails it with the command's last lines, two deploys of one env never
run it at once, and an ending deployment cancels it in the same write."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, deployment_of
from services.orchestrator.phases import decide
from services.orchestrator.release import failure_reason, release_job_id
from shared import jobs as J
from shared import keys as K
from shared.clock import stamp
from shared.txn import Conflict, Writer
from tests.factories import node
from tests.orchestrator.rig import copied, deployment, environment, release, replica, spec
from tests.orchestrator.test_phases import ENV, T0, Board
from tests.waiting import eventually

PH = pb.DeploymentPhase
TIMERS = Timers()


def release_board(*, command: str = "python manage.py migrate", rollback: bool = False) -> Board:
    b = Board()
    s = spec(1)
    s.release_command = command
    b.put(
        node("n1", cpu=1000, mem=4096),
        release("rel1", ENV, "app:v1", s, version=1),
        release("rel2", ENV, "app:v2", s, version=2),
        environment(ENV, s, active="rel1"),
        replica("blue-0", "n1", ENV, "rel1"),
    )
    d = deployment("dep1", ENV, "rel2", previous="rel1", now=T0)
    d.is_rollback = rollback
    b.put(d)
    return b


def job(b: Board, deployment_id: str = "dep1") -> pb.Job:
    found = b.view.get(K.JOB, release_job_id(deployment_id))
    assert isinstance(found, pb.Job)
    return found


def finish(b: Board, status: int, *, code: int | None = None, tail: tuple[str, ...] = (), message: str = "") -> None:
    done = copied(job(b))
    done.status = status  # type: ignore[assignment]
    done.exit_code_known = code is not None
    done.exit_code = code or 0
    done.output_tail.extend(tail)
    done.message = message
    b.put(done)


def test_the_command_runs_before_any_green_replica_is_placed() -> None:
    b = release_board()
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_RELEASING
    t = b.step()
    assert t is not None and [type(m) for m in t.creates] == [pb.Job]
    created = job(b)
    assert (created.command, created.release_id, created.deployment_id) == ("python manage.py migrate", "rel2", "dep1")
    assert created.max_retries == 0 and b.d().release_job_id == created.meta.id
    assert b.green() == [] and b.d().phase == PH.DEPLOYMENT_PHASE_RELEASING
    assert b.decide() is None  # waiting on the job
    finish(b, J.SUCCEEDED, code=0)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_PLACING


def test_a_failing_command_fails_the_deployment_with_its_last_lines() -> None:
    b = release_board()
    b.step()
    b.step()
    finish(b, J.FAILED, code=3, tail=("Applying 0002...", "django.db.utils.OperationalError: boom"), message="exit 3")
    t = b.step()
    assert t is not None
    d = b.d()
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED
    assert d.error.startswith("release command failed (exit 3)")
    assert "OperationalError: boom" in d.error
    env = b.view.env(ENV)
    assert env is not None and env.active_release_id == "rel1"  # nothing promoted
    assert [e.kind for e in t.events] == ["deploy.failed"]


def test_no_command_and_rollbacks_skip_the_phase() -> None:
    b = release_board(command="")
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_PLACING
    b = release_board(rollback=True)
    b.step()
    assert b.d().phase != PH.DEPLOYMENT_PHASE_RELEASING


def test_a_build_that_succeeds_goes_to_the_release_phase() -> None:
    b = release_board()
    rel2 = copied(b.view.release("rel2"))
    rel2.image_ref = ""
    build = pb.Build(environment_id=ENV, status=pb.BUILD_STATUS_SUCCEEDED, image_ref="app:v2")
    build.meta.id = "b1"
    d = copied(b.d())
    d.build_id = "b1"
    b.put(rel2, build, d)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_BUILDING
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_RELEASING


def test_two_deploys_of_one_env_never_run_it_at_once() -> None:
    b = release_board()
    other = pb.Job(environment_id=ENV, deployment_id="dep0", status=J.RUNNING, command="x")
    other.meta.id = release_job_id("dep0")
    b.put(other)
    b.step()  # -> RELEASING
    assert b.decide() is None  # dep0's command still runs
    other.status = J.CANCELED
    b.put(other)
    t = b.step()
    assert t is not None and t.creates and job(b).deployment_id == "dep1"


def test_a_superseding_deployment_cancels_the_running_command() -> None:
    b = release_board()
    b.step()
    b.step()
    newer = deployment("dep2", ENV, "rel2", previous="rel1", now=T0 + 1)
    b.put(newer)
    t = b.step(T0 + 2)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUPERSEDED
    assert job(b).cancel_requested


def test_the_phase_times_out_and_cancels_its_command() -> None:
    b = release_board()
    b.step()
    b.step()
    running = copied(job(b))
    running.status = J.RUNNING
    b.put(running)
    t = b.step(T0 + TIMERS.releasing_timeout + 1)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert "RELEASING timed out" in deployment_of(t).error and job(b).cancel_requested


def test_an_operator_cancel_cancels_the_command() -> None:
    b = release_board()
    b.step()
    b.step()
    d = copied(b.d())
    d.error = "canceled by operator"
    b.put(d)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_FAILED and job(b).cancel_requested


@pytest.mark.parametrize(
    ("status", "code", "message", "tail", "expected"),
    [
        (J.FAILED, 1, "exit code 1", (), "release command failed (exit 1)"),
        (J.FAILED, 2, "exit 2", ("a", "", "b"), "release command failed (exit 2): exit 2; last lines: a | b"),
        (J.CANCELED, None, "canceled", (), "release command failed (canceled): canceled"),
        (J.FAILED, None, "not placed within its deadline: waiting", (), "release command failed (failed): not placed"),
    ],
)
def test_failure_reason(status: int, code: int | None, message: str, tail: tuple[str, ...], expected: str) -> None:
    j = pb.Job(status=status, exit_code_known=code is not None, exit_code=code or 0, message=message)  # type: ignore[arg-type]
    j.output_tail.extend(tail)
    assert failure_reason(j).startswith(expected)


def test_failure_reason_bounds_long_output() -> None:
    j = pb.Job(status=J.FAILED, exit_code_known=True, exit_code=1)
    j.output_tail.extend(["x" * 400] * 10)
    assert len(failure_reason(j)) < 1700


def test_the_timer_wakes_the_loop() -> None:
    from services.orchestrator.phases import wake_at

    b = release_board()
    b.step()
    d = copied(b.d())
    stamp(d.meta.updated_at, T0)
    b.put(d)
    wake = wake_at(b.view, b.d(), TIMERS)
    assert wake is not None and wake > T0 + TIMERS.releasing_timeout


async def test_two_leaders_deciding_the_same_step_create_the_command_once(writer: Writer) -> None:
    """On real NATS: two decisions made on the same view (a deposed leader and its successor) both create
    the release job; the second batch is refused whole, so the command runs once."""
    b = release_board()
    b.step()  # -> RELEASING
    d = b.d()
    await writer.commit(writer.txn().extend(creates=[*b.state.store.all(K.NODE), *_records(b), d]))
    await eventually(lambda: writer.view.deployment("dep1") is not None, what="the seeded deployment in the view")
    first = decide(writer.view, d, T0, TIMERS)
    second = decide(writer.view, d, T0, TIMERS)
    assert first is not None and second is not None and first.creates and second.creates
    first_txn, second_txn = first.txn(writer), second.txn(writer)
    await writer.commit(first_txn)
    with pytest.raises(Conflict):
        await writer.commit(second_txn)
    await eventually(lambda: writer.view.get(K.JOB, release_job_id("dep1")) is not None, what="the job")
    assert [j.meta.id for j in writer.view.jobs(ENV)] == [release_job_id("dep1")]


def _records(b: Board) -> list[Message]:
    view = b.state.store
    env = view.env(ENV)
    assert env is not None
    return [*view.releases(ENV), env, *view.assignments(ENV)]


def test_a_stateful_env_runs_the_command_before_stopping_its_instance() -> None:
    from tests.orchestrator.test_phases import stateful_board

    b = stateful_board()
    for rel_id in ("rel1", "rel2"):
        rel = copied(b.view.release(rel_id))
        rel.service.release_command = "migrate"
        b.put(rel)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_RELEASING
    b.step()
    finish(b, J.SUCCEEDED, code=0)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_STOPPING_OLD
