"""Deployment phases and who owns an environment's replicas: the contract between scheduler,
orchestrator and the scaling loops.

A non-terminal deployment owns its env; the scheduler and scaling loops leave it alone. Once a deployment
is promoted (DRAINING_OLD), the scheduler owns the **active**
release's replicas again (node-loss replacement, scaling, cooling); only the blue set (the deployment's
``previous_release_id``) is held warm by the deployment until the drain completes. When a deployment
targets its own previous release (a redeploy, a rollback to the active release), blue and green share
that release: blue is then the release's replicas *not* tagged with the deployment, and the scheduler
counts only the green ones until the drain decides which of the others to keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from zattera.v1 import types_pb2 as pb

from shared.state.reader import StateReader

P = pb.DeploymentPhase

TERMINAL_PHASES: frozenset[int] = frozenset(
    {
        pb.DEPLOYMENT_PHASE_UNSPECIFIED,
        pb.DEPLOYMENT_PHASE_SUCCEEDED,
        pb.DEPLOYMENT_PHASE_FAILED,
        pb.DEPLOYMENT_PHASE_ROLLED_BACK,
        pb.DEPLOYMENT_PHASE_SUPERSEDED,
    }
)


def is_terminal(phase: int) -> bool:
    return phase in TERMINAL_PHASES


def active_deployments(view: StateReader, env_id: str) -> list[pb.Deployment]:
    """Non-terminal deployments of an env, oldest first."""
    return [d for d in view.deployments(env_id) if not is_terminal(d.phase)]


@dataclass(frozen=True, slots=True)
class Ownership:
    """Who manages an env's replicas right now."""

    deployment: pb.Deployment | None
    scheduler_manages: bool
    held_release_ids: frozenset[str]
    """Releases whose replicas are blue: held by a draining deployment, not the scheduler's."""
    redeploy_ids: frozenset[str] = frozenset()
    """Draining deployments that target their own previous release."""
    redeploy_started_ns: int = 0
    """When the first of them was created: that release's replicas from before it, not tagged with one of
    them, are blue (replicas the scheduler created since, e.g. to replace a lost node, are not)."""

    def is_blue(self, assignment: pb.Assignment) -> bool:
        if assignment.release_id not in self.held_release_ids:
            return False
        if not self.redeploy_ids:
            return True
        return (
            assignment.deployment_id not in self.redeploy_ids
            and assignment.meta.created_at.ToNanoseconds() < self.redeploy_started_ns
        )


def env_ownership(view: StateReader, env_id: str) -> Ownership:
    live = active_deployments(view, env_id)
    if not live:
        return Ownership(None, True, frozenset())
    newest = live[-1]
    if all(d.phase == pb.DEPLOYMENT_PHASE_DRAINING_OLD for d in live):
        held = frozenset(d.previous_release_id for d in live if d.previous_release_id)
        redeploys = [d for d in live if d.previous_release_id == d.release_id]
        started = min((d.meta.created_at.ToNanoseconds() for d in redeploys), default=0)
        return Ownership(newest, True, held, frozenset(d.meta.id for d in redeploys), started)
    return Ownership(newest, False, frozenset())


def desired_replicas(env: pb.Environment) -> int:
    """The replica count the scheduler converges an env to: 0
    without an active release; a scale-to-zero env's ``effective_replicas`` exactly (0 = cold); else
    ``effective_replicas`` when set, otherwise the env's live ``replicas.min``. The scaling loops read
    the current count the same way."""
    if not env.active_release_id:
        return 0
    if env.service.scale_to_zero:
        return env.effective_replicas
    return env.effective_replicas or env.service.replicas.min


def owns_scaling(view: StateReader, env_id: str) -> bool:
    """True while a deployment that is not yet promoted holds the env (the scaling loops skip it). Once
    every live deployment of the env is promoted (DRAINING_OLD: only its blue is held warm), scaling and
    cooling proceed, not held for the whole drain window."""
    return not env_ownership(view, env_id).scheduler_manages


_UP = frozenset(
    {pb.INSTANCE_STATE_STARTING, pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY}
)


def replica_role(view: StateReader, assignment: pb.Assignment) -> str:
    """How a replica takes part in its env's traffic, in a word or three (``zattera ps``):

    ``serving`` (the active release), ``draining until <UTC time>`` (the previous release, kept warm after a
    promotion until the drain deadline: no new requests), ``green`` (a release being deployed, not switched
    to yet), ``old`` (another release, not held by a drain), ``stopping`` (desired STOP, still up), ``job``
    (a one-shot run); `` (node draining)`` is added when its node is being drained."""
    env = view.env(assignment.environment_id)
    if assignment.job_id:
        role = "job"
    elif assignment.desired != pb.ASSIGNMENT_DESIRED_RUN:
        role = "stopping" if assignment.observed.state in _UP else "stopped"
    elif env is None:
        role = "old"
    elif env_ownership(view, env.meta.id).is_blue(assignment):
        deadlines = [
            d.drain_deadline.ToSeconds()
            for d in active_deployments(view, env.meta.id)
            if d.previous_release_id == assignment.release_id and d.HasField("drain_deadline")
        ]
        role = f"draining until {_utc(min(deadlines))}" if deadlines else "draining"
    elif assignment.release_id == env.active_release_id:
        role = "serving"
    elif any(d.release_id == assignment.release_id for d in active_deployments(view, env.meta.id)):
        role = "green"
    else:
        role = "old"
    node = view.node(assignment.node_id)
    if node is not None and node.status == pb.NODE_STATUS_DRAINING:
        role += " (node draining)"
    return role


def _utc(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%H:%M:%S UTC")
