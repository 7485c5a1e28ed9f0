"""When an instance's process is started again, and when the agent gives up on it: pure rules, no I/O.

Both runtimes (bare processes and containers, ``launchers.py``) share them, through the supervisor
(``runtime.py``), which keeps one :class:`StartHistory` per assignment and asks the policy at each turn:

* :meth:`RestartPolicy.before_start` — start now, wait out a backoff, or stay parked;
* :meth:`RestartPolicy.after_failed_start` — a start that failed, or a process that exited on its own;
* :meth:`RestartPolicy.after_unanswered` — a start that a cluster service's silence kept from beginning;
* :meth:`RestartPolicy.after_exit` — the process exited: how long it ran decides whether the failed-start
  count resets; a job is never restarted.

The rules: every failed start counts (not a start held up by a service that did not answer: it is tried
again every ``backoff`` seconds); the next start waits ``backoff · 2^(failures-1)`` seconds (at most
``backoff_max``); ``max_start_attempts`` failed starts of one config park the assignment FAILED. A run of
``stable_after`` seconds or more resets the count, and so does a new config (release, config hash, image).
A job runs once: its exit parks it, as does finding it ended under a previous agent run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

from shared.backoff import exponential

if TYPE_CHECKING:
    from services.agent.settings import AgentSettings


@dataclass(frozen=True)
class StartHistory:
    """What the policy remembers of one assignment's starts (times are the injected clock's seconds)."""

    config: str = ""
    """What the counted starts ran (``runtime.config_of``); another config starts afresh."""
    failures: int = 0
    """Failed starts of this config since its last stable run."""
    parked: bool = False
    """Given up (FAILED) or a job that ended: nothing is started until the config changes."""
    not_before: float = 0.0
    """No start before this time (the backoff after a failed start)."""
    started_at: float = 0.0
    """When the current process was started or adopted (0: none yet)."""


class Step(Enum):
    START = "start"
    WAIT = "wait"
    """Backing off: ask again after :attr:`Plan.wait` seconds (or on any change)."""
    PARKED = "parked"


@dataclass(frozen=True)
class Plan:
    step: Step
    history: StartHistory
    wait: float = 0.0


class Verdict(Enum):
    RESTART = "restart"
    """Start again after :attr:`Outcome.delay` seconds."""
    GIVE_UP = "give up"
    """Too many failed starts: parked, reported FAILED."""
    JOB_ENDED = "job ended"
    """A job's one run ended: parked, reported STOPPED (exit code 0) or FAILED."""


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    history: StartHistory
    delay: float = 0.0
    ran: float = 0.0
    """How long the exited process ran (seconds; 0 for a start that failed)."""


@dataclass(frozen=True)
class RestartPolicy:
    max_start_attempts: int
    backoff: float
    backoff_max: float
    stable_after: float

    @classmethod
    def of(cls, settings: AgentSettings) -> RestartPolicy:
        """The policy the agent's settings say."""
        return cls(
            max_start_attempts=settings.max_start_attempts,
            backoff=settings.restart_backoff,
            backoff_max=settings.restart_backoff_max,
            stable_after=settings.stable_after,
        )

    def before_start(self, history: StartHistory, config: str, now: float, *, job_ended_before: bool) -> Plan:
        """The instance runs nothing and wants to run ``config``: start it now, later, or not at all.
        ``job_ended_before``: it is a job whose observed state says it already ran (under an earlier agent)."""
        if config != history.config:
            history = StartHistory(config=config)
        if job_ended_before:
            history = replace(history, parked=True)
        if history.parked:
            return Plan(Step.PARKED, history)
        wait = history.not_before - now
        if wait > 0:
            return Plan(Step.WAIT, history, wait)
        return Plan(Step.START, history)

    def started(self, history: StartHistory, now: float) -> StartHistory:
        """A process was started (or adopted) at ``now``."""
        return replace(history, started_at=now)

    def after_failed_start(self, history: StartHistory, now: float) -> Outcome:
        """A start failed (no image, no command, no secrets, spawn refused) or the process exited."""
        failures = history.failures + 1
        if failures >= self.max_start_attempts:
            return Outcome(Verdict.GIVE_UP, replace(history, failures=failures, parked=True))
        delay = exponential(self.backoff, failures, self.backoff_max)
        return Outcome(Verdict.RESTART, replace(history, failures=failures, not_before=now + delay), delay)

    def after_unanswered(self, history: StartHistory, now: float) -> Outcome:
        """A start that could not begin because a cluster service did not answer (the secrets service of a
        control plane still starting, or restarting for an upgrade): the app did not fail, so nothing is
        counted; it is tried again after the first backoff step, as long as it takes."""
        return Outcome(Verdict.RESTART, replace(history, not_before=now + self.backoff), self.backoff)

    def after_exit(self, history: StartHistory, now: float, *, job: bool) -> Outcome:
        """The process exited on its own at ``now``."""
        ran = now - history.started_at
        if job:
            return Outcome(Verdict.JOB_ENDED, replace(history, parked=True), ran=ran)
        if ran >= self.stable_after:
            history = replace(history, failures=0)
        return replace(self.after_failed_start(history, now), ran=ran)
