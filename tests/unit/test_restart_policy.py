"""The agent's restart rules (``services/agent/restart_policy.py``) as tables, on a fake clock's times."""

from __future__ import annotations

import pytest

from services.agent.restart_policy import Outcome, RestartPolicy, StartHistory, Step, Verdict

POLICY = RestartPolicy(max_start_attempts=3, backoff=1.0, backoff_max=30.0, stable_after=10.0)
NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("history", "config", "job_ended_before", "step", "wait", "after"),
    [
        # Nothing started yet: start at once.
        (StartHistory(), "c1", False, Step.START, 0.0, StartHistory(config="c1")),
        # Backing off: the rest of the delay.
        (StartHistory("c1", 1, not_before=NOW + 4), "c1", False, Step.WAIT, 4.0, StartHistory("c1", 1, 0, NOW + 4)),
        # The backoff is over.
        (StartHistory("c1", 2, not_before=NOW), "c1", False, Step.START, 0.0, StartHistory("c1", 2, not_before=NOW)),
        # Parked (given up): stays so for the same config...
        (StartHistory("c1", 3, parked=True), "c1", False, Step.PARKED, 0.0, StartHistory("c1", 3, parked=True)),
        # ...and a new config starts afresh: no count, no backoff, not parked.
        (StartHistory("c1", 3, parked=True, not_before=NOW + 9), "c2", False, Step.START, 0.0, StartHistory("c2")),
        (StartHistory("c1", 1, not_before=NOW + 9), "c2", False, Step.START, 0.0, StartHistory("c2")),
        # A job that ended under an earlier agent run never runs again.
        (StartHistory(), "c1", True, Step.PARKED, 0.0, StartHistory(config="c1", parked=True)),
    ],
)
def test_before_start(
    history: StartHistory, config: str, job_ended_before: bool, step: Step, wait: float, after: StartHistory
) -> None:
    plan = POLICY.before_start(history, config, NOW, job_ended_before=job_ended_before)
    assert (plan.step, plan.wait, plan.history) == (step, pytest.approx(wait), after)


@pytest.mark.parametrize(
    ("failures", "outcome"),
    [
        (0, Outcome(Verdict.RESTART, StartHistory("c1", 1, not_before=NOW + 1.0), delay=1.0)),
        (1, Outcome(Verdict.RESTART, StartHistory("c1", 2, not_before=NOW + 2.0), delay=2.0)),
        (2, Outcome(Verdict.GIVE_UP, StartHistory("c1", 3, parked=True))),
    ],
)
def test_a_failed_start_backs_off_then_gives_up(failures: int, outcome: Outcome) -> None:
    assert POLICY.after_failed_start(StartHistory("c1", failures), NOW) == outcome


@pytest.mark.parametrize("failures", [0, 2, 50])
def test_a_start_a_silent_service_held_up_is_tried_again_and_never_counted(failures: int) -> None:
    """The secrets service of a control plane still starting (or restarting for an upgrade) did not answer:
    not the app's failure. Before, three such starts within three seconds parked an app FAILED for good."""
    history = StartHistory("c1", failures)
    outcome = POLICY.after_unanswered(history, NOW)
    assert outcome == Outcome(Verdict.RESTART, StartHistory("c1", failures, not_before=NOW + 1.0), delay=1.0)
    plan = POLICY.before_start(outcome.history, "c1", NOW + 1.0, job_ended_before=False)
    assert plan.step is Step.START


def test_the_backoff_stops_growing_at_its_ceiling() -> None:
    patient = RestartPolicy(max_start_attempts=100, backoff=1.0, backoff_max=30.0, stable_after=10.0)
    outcome = patient.after_failed_start(StartHistory("c1", 40), NOW)
    assert (outcome.verdict, outcome.delay, outcome.history.not_before) == (Verdict.RESTART, 30.0, NOW + 30.0)


@pytest.mark.parametrize(
    ("ran", "failures_before", "verdict", "failures_after", "delay"),
    [
        (0.5, 0, Verdict.RESTART, 1, 1.0),  # a crash right after the start counts
        (9.9, 1, Verdict.RESTART, 2, 2.0),  # not quite stable: the count goes on
        (9.9, 2, Verdict.GIVE_UP, 3, 0.0),  # the third failed start of this config
        (10.0, 2, Verdict.RESTART, 1, 1.0),  # a stable run reset the count first
        (3600.0, 2, Verdict.RESTART, 1, 1.0),
    ],
)
def test_an_exit_counts_as_a_failed_start_unless_the_run_was_stable(
    ran: float, failures_before: int, verdict: Verdict, failures_after: int, delay: float
) -> None:
    history = POLICY.started(StartHistory("c1", failures_before), NOW - ran)
    outcome = POLICY.after_exit(history, NOW, job=False)
    assert (outcome.verdict, outcome.history.failures, outcome.delay, outcome.ran) == (
        verdict,
        failures_after,
        delay,
        pytest.approx(ran),
    )
    assert outcome.history.parked == (verdict is Verdict.GIVE_UP)


@pytest.mark.parametrize("failures_before", [0, 2])
def test_a_job_runs_once(failures_before: int) -> None:
    history = POLICY.started(StartHistory("c1", failures_before), NOW - 2.0)
    outcome = POLICY.after_exit(history, NOW, job=True)
    assert (outcome.verdict, outcome.history.parked, outcome.ran) == (Verdict.JOB_ENDED, True, 2.0)
    assert POLICY.before_start(outcome.history, "c1", NOW + 3600, job_ended_before=False).step is Step.PARKED


def test_a_crash_loop_on_the_clock() -> None:
    """Start, crash at once, wait out each backoff, give up on the third failed start."""
    history, now, seen = StartHistory(), NOW, []
    while True:
        plan = POLICY.before_start(history, "c1", now, job_ended_before=False)
        if plan.step is Step.PARKED:
            break
        if plan.step is Step.WAIT:
            seen.append(("wait", plan.wait))
            now += plan.wait
            history = plan.history
            continue
        history = POLICY.started(plan.history, now)
        now += 0.1
        outcome = POLICY.after_exit(history, now, job=False)
        seen.append((outcome.verdict.value, outcome.delay))
        history = outcome.history
    assert seen == [
        ("restart", 1.0),
        ("wait", pytest.approx(1.0)),
        ("restart", 2.0),
        ("wait", pytest.approx(2.0)),
        ("give up", 0.0),
    ]
