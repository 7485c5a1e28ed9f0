"""What every phase decision shares: timers, the transitions a decision produces, the replica sets
(green, blue, old) recomputed from the view on every decision, and the two failure exits.

A decision is pure: it reads a :class:`~shared.state.reader.StateReader` and the time, and returns a
:class:`~shared.decision.Decision` (or None: nothing to do yet). The loop commits it as ONE fenced atomic
batch; every decision fences on the deployment itself (a phase change, or an unchanged re-write), so
any concurrent change to the deployment (an operator's cancel, another leader) refuses the whole batch
and the decision is taken again on fresh state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.orchestrator.settings import DEFAULTS as OWN
from services.orchestrator.settings import OrchestratorSettings
from shared import keys as K
from shared.applogs import describe_exit
from shared.clock import from_timestamp, stamp
from shared.decision import Decision
from shared.deploy import CANCELED_BY_OPERATOR
from shared.events import ERROR, INFO, WARNING, make_event, transition_id
from shared.placement.replicas import deploy_replicas, with_desired
from shared.settings import DEFAULTS as SHARED
from shared.settings import Settings
from shared.state.reader import StateReader

P = pb.DeploymentPhase
RUN = pb.ASSIGNMENT_DESIRED_RUN
STOP = pb.ASSIGNMENT_DESIRED_STOP

# Failure strings (deployment.error and the deploy.failed event message: operators and scripts read them).
ENV_NOT_FOUND = "environment not found"
RELEASE_NOT_FOUND = "release not found"
NO_IMAGE = "release has no image ref"
BUILD_NOT_FOUND = "build not found"
BUILD_PRODUCED_NO_IMAGE = "build produced no image"
BUILD_FAILED = "build failed: "
GREEN_FAILED_TO_START = "a green instance failed to start"
GREEN_UNHEALTHY = "a green instance became unhealthy"
GREEN_NOT_HEALTHY_IN_TIME = "green instances did not become healthy in time"
SUPERSEDED = "superseded by a newer deployment"
NO_NODE_FOR_STATEFUL = "no node available for the stateful instance: "
NEW_INSTANCE_FAILED_TO_START = "the new instance failed to start"
NEW_INSTANCE_UNHEALTHY = "the new instance became unhealthy"
NEW_INSTANCE_NOT_HEALTHY_IN_TIME = "the new instance did not become healthy in time"

MAINTENANCE_START = "stateful update: stopping the current instance (brief downtime)"
MAINTENANCE_END = "stateful update: new instance healthy and promoted"
RESTARTED_PREVIOUS = "stateful update failed; restarted the previous instance"
OPERATOR = "operator"

# Nodes whose replicas receive no traffic (the route builder skips them): a green there is lost.
LOST_NODE_STATUSES = frozenset({pb.NODE_STATUS_DOWN, pb.NODE_STATUS_DRAINED})

UP_STATES = frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY})
GONE_STATES = frozenset({pb.INSTANCE_STATE_STOPPED, pb.INSTANCE_STATE_FAILED, pb.INSTANCE_STATE_UNSPECIFIED})


@dataclass(frozen=True, slots=True)
class Timers:
    """Every duration the phase machine waits on, in seconds."""

    drain_window: float = SHARED.drain_window
    health_default_grace: float = SHARED.health_default_grace
    health_deadline_extra: float = OWN.health_deadline_extra
    building_timeout: float = OWN.building_timeout
    placing_timeout: float = OWN.placing_timeout
    starting_timeout: float = OWN.starting_timeout
    stopping_old_timeout: float = OWN.stopping_old_timeout
    releasing_timeout: float = OWN.releasing_timeout
    drain_quiet: float = OWN.drain_quiet

    @classmethod
    def from_settings(cls, shared: Settings, own: OrchestratorSettings) -> Timers:
        """The two shared durations, and every orchestrator setting (each one is a timer of this class)."""
        return cls(
            drain_window=shared.drain_window, health_default_grace=shared.health_default_grace, **own.model_dump()
        )

    def health_deadline(self, release: pb.Release) -> float:
        """2 x grace + extra (+ the release's minimum healthy time), grace = the release's healthcheck grace
        period, else the default."""
        grace_field = release.service.healthcheck.grace_period
        grace = grace_field.seconds + grace_field.nanos / 1e9
        if grace <= 0:
            grace = self.health_default_grace
        minimum = release.service.min_healthy_time
        return 2 * grace + self.health_deadline_extra + minimum.seconds + minimum.nanos / 1e9

    def phase_timeout(self, phase: int) -> float | None:
        """How long a waiting phase may last before the deployment fails (None: not a timed wait)."""
        timeouts: dict[int, float] = {
            pb.DEPLOYMENT_PHASE_BUILDING: self.building_timeout,
            pb.DEPLOYMENT_PHASE_PLACING: self.placing_timeout,
            pb.DEPLOYMENT_PHASE_STARTING: self.starting_timeout,
            pb.DEPLOYMENT_PHASE_STOPPING_OLD: self.stopping_old_timeout,
            pb.DEPLOYMENT_PHASE_RELEASING: self.releasing_timeout,
        }
        return timeouts.get(phase)

    def overdue(self, d: pb.Deployment, now: float) -> str | None:
        """Why ``d`` fails when its phase has lasted strictly longer than :meth:`phase_timeout` ("placing timed
        out after 10m", the cause to follow); None while it has not, or for a phase that is not a timed wait."""
        limit = self.phase_timeout(d.phase)
        entered = phase_entered_at(d)
        if limit is None or entered is None or now <= entered + limit:
            return None
        return f"{phase_label(d.phase)} timed out after {format_duration(limit)}"


# ---------------------------------------------------------------------- time


def phase_entered_at(d: pb.Deployment) -> float | None:
    """When the current phase began (meta.updated_at); None when never stamped (no timer runs)."""
    return from_timestamp(d.meta.updated_at) if d.meta.HasField("updated_at") else None


def format_duration(secs: float) -> str:
    """90 -> "1m30s", 600 -> "10m", 1.5 -> "1.5s"."""
    if secs < 60:
        return f"{secs:g}s"
    minutes, rest = divmod(round(secs), 60)
    return f"{minutes}m{rest}s" if rest else f"{minutes}m"


def state_name(state: int) -> str:
    return pb.InstanceState.Name(state).removeprefix("INSTANCE_STATE_")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- replica sets


def tagged(view: StateReader, d: pb.Deployment) -> list[pb.Assignment]:
    """Every assignment this deployment created, whatever its desired state."""
    return [a for a in view.assignments(d.environment_id) if a.deployment_id == d.meta.id]


def green(view: StateReader, d: pb.Deployment) -> list[pb.Assignment]:
    """green(d): this deployment's desired-RUN assignments."""
    return [a for a in tagged(view, d) if a.desired == RUN]


def old_instances(view: StateReader, d: pb.Deployment) -> list[pb.Assignment]:
    """old(d): the previous release's assignments not created by d, any desired state."""
    if not d.previous_release_id:
        return []
    return [
        a
        for a in view.assignments(d.environment_id)
        if a.release_id == d.previous_release_id and a.deployment_id != d.meta.id and not a.job_id
    ]


def blue(view: StateReader, d: pb.Deployment) -> list[pb.Assignment]:
    """blue(d): the previous release's desired-RUN replicas not created by d (by release, not by tag)."""
    return [a for a in old_instances(view, d) if a.desired == RUN]


def node_lost(view: StateReader, node_id: str) -> bool:
    node = view.node(node_id)
    return node is None or node.status in LOST_NODE_STATUSES


def on_live_nodes(
    view: StateReader, assignments: Iterable[pb.Assignment]
) -> tuple[list[pb.Assignment], list[pb.Assignment]]:
    """(live, lost): split by whether the replica's node can still serve traffic."""
    live: list[pb.Assignment] = []
    lost: list[pb.Assignment] = []
    for a in assignments:
        (lost if node_lost(view, a.node_id) else live).append(a)
    return live, lost


def observed_summary(assignments: Sequence[pb.Assignment]) -> str:
    """'2 PULLING, 1 unreported' — for timeout reasons."""
    counts: dict[str, int] = {}
    for a in assignments:
        name = state_name(a.observed.state) if a.observed.state else "unreported"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))


CRASH_LINES = 5
CRASH_LINE_CHARS = 200


def failed_instance_reason(reason: str, instances: Sequence[pb.Assignment]) -> str:
    """``reason`` naming the first FAILED instance, how its process last ended and its last stderr lines, e.g.
    ``a green instance failed to start: instance 01J… on n1: exit code 3; last stderr: fatal: X not set``.
    ``reason`` alone when the agent reported nothing more."""
    failed = next((a for a in instances if a.observed.state == pb.INSTANCE_STATE_FAILED), None)
    if failed is None:
        return reason
    observed = failed.observed
    if observed.HasField("last_exit"):
        detail = describe_exit(observed.last_exit)
        tail = [line[:CRASH_LINE_CHARS] for line in observed.last_exit.stderr_tail[-CRASH_LINES:]]
        if tail:
            detail += "; last stderr: " + " | ".join(tail)
    elif observed.message:
        detail = observed.message
    else:
        return reason
    return f"{reason}: instance {failed.meta.id} on {failed.node_id}: {detail}"


# ---------------------------------------------------------------------- building transitions


M = TypeVar("M", bound=Message)


def copy_of(msg: M) -> M:
    dup = type(msg)()
    dup.CopyFrom(msg)
    return dup


def advance(d: pb.Deployment, phase: int, now: float) -> pb.Deployment:
    """The deployment entering ``phase`` now (meta.updated_at = phase entry)."""
    nxt = copy_of(d)
    nxt.phase = phase  # type: ignore[assignment]
    stamp(nxt.meta.updated_at, now)
    return nxt


def phase_label(phase: int) -> str:
    """The phase's name for logs and spans; a value this build does not know (a newer writer, or garbage)
    is shown as its number rather than failing the pass that reports it."""
    try:
        return P.Name(phase).removeprefix("DEPLOYMENT_PHASE_")  # type: ignore[arg-type]
    except ValueError:
        return f"UNKNOWN({phase})"


def move(
    d: pb.Deployment,
    phase: int,
    now: float,
    *,
    error: str = "",
    promoted_at: float | None = None,
    drain_deadline: float | None = None,
) -> Decision:
    """A transition into ``phase`` (a set error is sticky); callers add the writes that go with it."""
    entered = advance(d, phase, now)
    if error:
        entered.error = error
    if promoted_at is not None:
        stamp(entered.promoted_at, promoted_at)
    if drain_deadline is not None:
        stamp(entered.drain_deadline, drain_deadline)
    return Decision(f"{phase_label(d.phase)}->{phase_label(phase)}", fence=entered)


def deployment_of(t: Decision) -> pb.Deployment:
    """The deployment a decision writes (every one made by :func:`move` or :func:`stay` fences on it)."""
    assert isinstance(t.fence, pb.Deployment), f"{t.label}: an orchestrator decision fences on its deployment"
    return t.fence


def stay(d: pb.Deployment, why: str) -> Decision:
    """A transition that keeps the phase: the deployment is re-written unchanged to fence the batch."""
    return Decision(f"{phase_label(d.phase)}: {why}", fence=copy_of(d))


def promoted_env(env: pb.Environment, release_id: str) -> pb.Environment:
    """The env with the traffic switched: active release set and route generation bumped together."""
    nxt = pb.Environment()
    nxt.CopyFrom(env)
    nxt.active_release_id = release_id
    nxt.route_generation = env.route_generation + 1
    return nxt


def deploy_event(d: pb.Deployment, kind: str, message: str, severity: str, now: float) -> pb.Event:
    event = make_event(
        kind,
        message,
        severity=severity,
        project_id=d.project_id,
        app_id=d.app_id,
        environment_id=d.environment_id,
        fields={"deployment_id": d.meta.id},
    )
    stamp(event.meta.created_at, now)
    return event


def abort(view: StateReader, d: pb.Deployment, reason: str, now: float) -> Decision:
    """The red/green failure exit, ONE write: delete everything d created and set FAILED with the reason.

    Traffic never moved and blue is untouched. (Written separately, a crash between the two would leave an
    empty green set that could then pass as ready and be promoted.)
    """
    t = move(d, pb.DEPLOYMENT_PHASE_FAILED, now, error=reason)
    t.deletes = [K.assignment(a.node_id, a.meta.id) for a in tagged(view, d)]
    return t


def stateful_fail(view: StateReader, d: pb.Deployment, reason: str, now: float) -> Decision:
    """The stateful failure exit, ONE write: delete the new instance, restart the old one, set FAILED.

    Deleting the new instance and restarting the old one in the same batch keeps at most one
    desired-RUN instance per volume at every committed state.
    """
    t = abort(view, d, reason, now)
    restarted = [with_desired(a, RUN, now=now) for a in old_instances(view, d) if a.desired != RUN]
    t.puts = list(restarted)
    if restarted:
        rolled_back = deploy_event(d, "deploy.rolled_back", RESTARTED_PREVIOUS, WARNING, now)
        rolled_back.fields["trigger"] = "automatic"
        t.events.insert(0, rolled_back)
    return t


def outcome_events(d: pb.Deployment, after: pb.Deployment, now: float, release: str = "") -> list[pb.Event]:
    """The events a phase change announces: every outcome (succeeded, failed with its reason, canceled,
    superseded) and the traffic switch (promoted, or rolled back for a rollback deployment; a stateful
    one switches and succeeds in the same step). ``release``: how the messages name the target release
    (its version, ``v3``), else its id."""
    release = release or d.release_id
    if after.phase == d.phase:
        return []
    rollback = d.is_rollback
    if rollback and d.phase == pb.DEPLOYMENT_PHASE_PROMOTING and after.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED:
        switched = copy_of(after)
        switched.phase = pb.DEPLOYMENT_PHASE_DRAINING_OLD
        both = [*outcome_events(d, switched, now, release), *outcome_events(switched, after, now, release)]
        for event in both:
            event.fields.update(from_phase=phase_label(d.phase), to_phase=phase_label(after.phase))
        return both
    if after.phase == pb.DEPLOYMENT_PHASE_FAILED and after.error == CANCELED_BY_OPERATOR:
        kind, message, severity = "deploy.canceled", CANCELED_BY_OPERATOR, WARNING
    elif after.phase == pb.DEPLOYMENT_PHASE_FAILED:
        kind, message, severity = "deploy.failed", after.error, ERROR
    elif after.phase == pb.DEPLOYMENT_PHASE_SUPERSEDED:
        kind, message, severity = "deploy.superseded", SUPERSEDED, WARNING
    elif after.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED:
        what = "rollback" if rollback else "deployment"
        kind, message, severity = "deploy.succeeded", f"{what} of release {release} succeeded", INFO
    elif after.phase == pb.DEPLOYMENT_PHASE_DRAINING_OLD and rollback:
        kind, message, severity = "deploy.rolled_back", f"traffic rolled back to release {release}", WARNING
    elif after.phase == pb.DEPLOYMENT_PHASE_DRAINING_OLD:
        kind, message, severity = "deploy.promoted", f"traffic switched to release {release}", INFO
    else:
        return []
    event = deploy_event(d, kind, message, severity, now)
    event.fields.update(
        {
            "from_phase": phase_label(d.phase),
            "to_phase": phase_label(after.phase),
            "release_id": d.release_id,
            "release": release,
            "previous_release_id": d.previous_release_id,
            "rollback": str(rollback).lower(),
        }
    )
    if after.error:
        event.fields["reason"] = after.error
    if kind == "deploy.rolled_back":
        event.fields["trigger"] = OPERATOR
    return [event]


def with_transition_ids(d: pb.Deployment, events: list[pb.Event], revision: int) -> None:
    """Name each event after the deployment's revision the step was decided on (its Nats-Msg-Id)."""
    for event in events:
        event.transition = transition_id(K.deployment(d.meta.id), revision, event.kind)


def back_to_placing(view: StateReader, d: pb.Deployment, lost: list[pb.Assignment], now: float) -> Decision:
    """The green set shrank (node lost, external stop) or the target grew: re-place before promoting."""
    t = move(d, pb.DEPLOYMENT_PHASE_PLACING, now)
    t.deletes = [K.assignment(a.node_id, a.meta.id) for a in lost]
    return t


def green_setback(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, failed: str
) -> tuple[Decision | None, list[pb.Assignment]]:
    """What interrupts a green set on its way up: a failed instance aborts (``failed`` names the phase's
    failure), a lost or missing replica sends it back to placing; else (None, the green replicas on
    live nodes)."""
    instances = green(view, d)
    if any(a.observed.state == pb.INSTANCE_STATE_FAILED for a in instances):
        return abort(view, d, failed_instance_reason(failed, instances), now), []
    live, lost = on_live_nodes(view, instances)
    if lost or len(live) < deploy_replicas(env, release):
        return back_to_placing(view, d, lost, now), []
    return None, live
