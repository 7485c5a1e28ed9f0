"""Pure replica rules shared by the scheduler and the deployment orchestrator.

* :func:`desired_replicas` is the scheduler's target: the env's live spec and the scaling loops'
  ``effective_replicas``; :func:`deploy_replicas` sizes a red/green green set from the release's frozen
  spec (it ignores scale-to-zero: a deploy starts warm).
* :func:`new_assignment` and :func:`stopped` build the assignment writes both services make; times come
  from the caller's injected clock, never the wall clock.
* :func:`node_is_down` is the broad "down": missing or anything but ALIVE.
* :func:`stop_is_reapable`: when a STOP assignment may go, so none leaks.
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared.clock import from_timestamp, stamp
from shared.deployments import desired_replicas
from shared.records import new_meta
from shared.state.reader import StateReader

__all__ = ["desired_replicas"]

RUN = pb.ASSIGNMENT_DESIRED_RUN
STOP = pb.ASSIGNMENT_DESIRED_STOP
STOPPED = pb.INSTANCE_STATE_STOPPED
FAILED = pb.INSTANCE_STATE_FAILED
ALIVE = pb.NODE_STATUS_ALIVE

STOP_REPORT_GRACE = 300.0
"""A STOP assignment no agent has reported on (or only as FAILED) for this long is deleted."""


def deploy_replicas(env: pb.Environment, release: pb.Release) -> int:
    """Size of a red/green green set: the scaling loops' count, else the release's own minimum."""
    if env.effective_replicas > 0:
        return env.effective_replicas
    return release.service.replicas.min


def new_assignment(
    env: pb.Environment,
    release: pb.Release,
    node_id: str,
    *,
    now: float,
    deployment_id: str = "",
    assignment_id: str | None = None,
) -> pb.Assignment:
    """A new RUN replica of ``release`` on ``node_id`` (project and app come from the env)."""
    a = pb.Assignment(
        node_id=node_id,
        project_id=env.project_id,
        app_id=env.app_id,
        environment_id=env.meta.id,
        release_id=release.meta.id,
        deployment_id=deployment_id,
        desired=RUN,
        config_hash=release.config_hash,
    )
    new_meta(a.meta, now, assignment_id)
    return a


def with_desired(a: pb.Assignment, desired: int, *, now: float) -> pb.Assignment:
    """A copy of ``a`` with a new desired state; ``updated_at`` marks when it changed."""
    copy = pb.Assignment()
    copy.CopyFrom(a)
    copy.ClearField("observed")
    copy.desired = desired  # type: ignore[assignment]
    stamp(copy.meta.updated_at, now)
    return copy


def stopped(a: pb.Assignment, *, now: float) -> pb.Assignment:
    return with_desired(a, STOP, now=now)


def node_is_down(view: StateReader, node_id: str) -> bool:
    """The node is missing or its status is anything but ALIVE."""
    node = view.node(node_id)
    return node is None or node.status != ALIVE


def stop_is_reapable(view: StateReader, a: pb.Assignment, now: float) -> bool:
    """A STOP assignment that can be deleted: once observed STOPPED, and, so that none waits forever for a
    report no agent will make, also when its node is DOWN or gone (the agent, if it returns, removes containers that
    have no assignment), or when for :data:`STOP_REPORT_GRACE` since the flip no agent reported it
    (or reported it only FAILED: a parked instance has no container to stop).
    """
    if a.desired != STOP:
        return False
    if a.observed.state == STOPPED:
        return True
    node = view.node(a.node_id)
    if node is None or node.status == pb.NODE_STATUS_DOWN:
        return True
    unreported = not a.HasField("observed") or a.observed.state in (pb.INSTANCE_STATE_UNSPECIFIED, FAILED)
    since = a.meta.updated_at if a.meta.HasField("updated_at") else a.meta.created_at
    return unreported and now - from_timestamp(since) >= STOP_REPORT_GRACE
