"""Replica convergence for one environment, a pure decision over the view.

Per env, in id order: skip it while a deployment owns it; partition its assignments; scale up through
Place; scale down by stopping the newest; reap what is stopped. The result is one atomic write.

Rules, each pinned by a test:

* A RUN replica observed FAILED (the agent gave up on it) does not count as good: it is stopped and
  replaced on another node when one fits, at most once per backoff window per env (10 s doubling to
  5 min), so a crash-looping release does not thrash; scale-down stops FAILED replicas first.
* STOP assignments that no agent will ever report STOPPED are reaped (:func:`stop_is_reapable`).
* A promoted deployment (DRAINING_OLD) does not freeze the env: the active release is managed as
  usual; only the blue release it keeps warm is left alone (``shared.deployments.env_ownership``).
* No replica of a stateful env is placed while one of its volumes is RESTORING (the restore is
  replacing the directory); placement resumes when the restore ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from services.scheduler.decisions import event
from shared import keys as K
from shared.backoff import exponential
from shared.decision import Decision
from shared.deployments import env_ownership
from shared.events import WARNING
from shared.placement.placement import PlacementError, PlacementIndex
from shared.placement.replicas import (
    FAILED,
    RUN,
    STOP,
    desired_replicas,
    new_assignment,
    stop_is_reapable,
    stopped,
)
from shared.state.reader import StateReader
from shared.state.tables import reservation
from shared.volumes import restoring_volume

BACKOFF_FIRST = 10.0
BACKOFF_MAX = 300.0


@dataclass(slots=True)
class _Streak:
    failures: int
    not_before: float
    last: float


class FailureBackoff:
    """Per-env spacing of failed-replica replacements: 10 s, 20 s, … up to 5 min.

    A streak is forgotten once the env has gone :data:`BACKOFF_MAX` without a replacement and has no
    FAILED replica left. Like every in-memory timer it starts over with a new leadership term.
    """

    def __init__(self) -> None:
        self._streaks: dict[str, _Streak] = {}

    def allows(self, env_id: str, now: float) -> bool:
        streak = self._streaks.get(env_id)
        return streak is None or now >= streak.not_before

    def record(self, env_id: str, now: float) -> float:
        """Note a replacement; returns the delay before the next one is allowed."""
        streak = self._streaks.get(env_id)
        failures = 1 if streak is None else streak.failures + 1
        delay = exponential(BACKOFF_FIRST, failures, BACKOFF_MAX)
        self._streaks[env_id] = _Streak(failures, now + delay, now)
        return delay

    def settle(self, env_id: str, now: float) -> None:
        """The env has no FAILED replica: end its streak once it has been quiet long enough."""
        streak = self._streaks.get(env_id)
        if streak is not None and now - streak.last >= BACKOFF_MAX:
            del self._streaks[env_id]

    def seconds_until_next(self, now: float) -> float | None:
        waits = [s.not_before - now for s in self._streaks.values() if s.not_before > now]
        return min(waits) if waits else None


@dataclass
class EnvDecision:
    env: pb.Environment
    writes: Decision
    shortfall: PlacementError | None = None
    """Why the env stays short of replicas after this pass (None: no shortfall)."""
    replaced_failed: list[pb.Assignment] = field(default_factory=list)


def _key(a: pb.Assignment) -> str:
    return K.assignment(a.node_id, a.meta.id)


def evaluate_env(
    view: StateReader, env: pb.Environment, now: float, *, index: PlacementIndex, backoff: FailureBackoff
) -> EnvDecision | None:
    """The env's changes (None: the scheduler leaves it alone). Decisions are accounted in ``index``."""
    env_id = env.meta.id
    ownership = env_ownership(view, env_id)
    if not ownership.scheduler_manages:
        return None
    release_id = env.active_release_id
    release = view.release(release_id) if release_id else None
    if release_id and release is None:
        return None  # nothing coherent to do; its replicas are reaped as orphans
    desired = desired_replicas(env)

    good: list[pb.Assignment] = []
    stale: list[pb.Assignment] = []
    deletes: list[pb.Assignment] = []
    for a in view.assignments(env_id):
        if a.job_id:
            continue
        if a.desired == STOP:
            if stop_is_reapable(view, a, now):
                deletes.append(a)
            continue
        if a.desired != RUN or ownership.is_blue(a):
            continue
        if a.release_id != release_id:
            stale.append(a)
            continue
        node = view.node(a.node_id)
        status = node.status if node is not None else pb.NODE_STATUS_UNSPECIFIED
        if status == pb.NODE_STATUS_ALIVE:
            good.append(a)
        elif status == pb.NODE_STATUS_DRAINING:
            continue  # left serving; a replacement goes elsewhere and the drain stops it
        elif release is not None and release.service.stateful:
            good.append(a)  # pinned to its volume: kept in place, never rescheduled
        else:
            deletes.append(a)

    decision = EnvDecision(env, Decision(f"env:{env_id}"))
    writes = decision.writes
    stops: list[pb.Assignment] = list(stale)

    def add_replicas(nodes: Sequence[str]) -> None:
        assert release is not None
        cpu, mem = reservation(release)
        for node_id in nodes:
            writes.creates.append(new_assignment(env, release, node_id, now=now))
            index.reserve(node_id, env_id, cpu, mem)

    missing = desired - len(good)
    restoring = release is not None and release.service.stateful and restoring_volume(view.volumes(env_id)) is not None
    if missing > 0 and release is not None and not restoring:
        picks, error = index.place(release, env_id, missing)
        add_replicas(picks)
        decision.shortfall = error
    elif missing < 0:
        by_preference = sorted(good, key=lambda a: (a.observed.state == FAILED, a.meta.id))
        stops.extend(by_preference[missing:])  # FAILED ones first, then the newest

    stopping = {a.meta.id for a in stops}
    failed = [a for a in good if a.observed.state == FAILED and a.meta.id not in stopping]
    if failed and release is not None and not release.service.stateful:
        if backoff.allows(env_id, now):
            picks, _ = index.place(release, env_id, len(failed), exclude={a.node_id for a in failed})
            add_replicas(picks)
            decision.replaced_failed = failed[: len(picks)]
            stops.extend(decision.replaced_failed)
            for old, node_id in zip(decision.replaced_failed, picks, strict=True):
                reason = f": {old.observed.message}" if old.observed.message else ""
                writes.events.append(
                    event(
                        "schedule.replica_failed",
                        f"replica {old.meta.id} on node {old.node_id} failed{reason}; replaced on node {node_id}",
                        now,
                        severity=WARNING,
                        env=env,
                    )
                )
    elif not failed:
        backoff.settle(env_id, now)

    for a in stops:
        writes.puts.append(stopped(a, now=now))
    writes.deletes.extend(_key(a) for a in deletes)
    for a in (*stops, *(a for a in deletes if a.desired == RUN)):
        cpu, mem = reservation(view.release(a.release_id))
        index.reserve(a.node_id, env_id, -cpu, -mem, replicas=-1)
    return decision


def evaluate_envs(view: StateReader, now: float, *, backoff: FailureBackoff) -> list[EnvDecision]:
    """Every env in id order, each seeing the reservations decided for the envs before it."""
    index = PlacementIndex(view)
    decisions = []
    for env in view.envs():
        decision = evaluate_env(view, env, now, index=index, backoff=backoff)
        if decision is not None:
            decisions.append(decision)
    return decisions
