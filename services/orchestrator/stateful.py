"""Stop-then-start deployments of stateful services (the target release has ``service.stateful``).

PENDING -> [BUILDING] -> STOPPING_OLD -> STARTING -> HEALTHCHECKING -> PROMOTING -> SUCCEEDED.
There is exactly one instance, and at every committed state at most one desired-RUN assignment holds
the volume: the old instance is flipped to STOP and must be observed gone before the new one is
placed; any failure after that deletes the new instance and restarts the old one in the same write.
While a volume of the env is RESTORING the new instance is not placed: STARTING waits (within its
timeout) for the restore to end, so the instance never starts on a directory being replaced.
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import (
    GONE_STATES,
    MAINTENANCE_END,
    MAINTENANCE_START,
    NEW_INSTANCE_FAILED_TO_START,
    NEW_INSTANCE_NOT_HEALTHY_IN_TIME,
    NEW_INSTANCE_UNHEALTHY,
    NO_NODE_FOR_STATEFUL,
    STOP,
    UP_STATES,
    Timers,
    deploy_event,
    failed_instance_reason,
    green,
    move,
    old_instances,
    phase_entered_at,
    promoted_env,
    state_name,
    stateful_fail,
    stay,
)
from shared.decision import Decision
from shared.events import INFO, WARNING
from shared.placement.placement import place
from shared.placement.replicas import new_assignment, with_desired
from shared.records import new_meta
from shared.state.reader import StateReader
from shared.volumes import restoring_volume

PH = pb.DeploymentPhase


def decide_stateful(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, timers: Timers
) -> Decision | None:
    """The stateful arm for phases after PENDING/BUILDING (those are shared with red/green)."""
    if d.phase == pb.DEPLOYMENT_PHASE_STOPPING_OLD:
        return stop_old(view, d, now, timers)
    if d.phase == pb.DEPLOYMENT_PHASE_STARTING:
        return start_new(view, d, env, release, now, timers)
    if d.phase == pb.DEPLOYMENT_PHASE_HEALTHCHECKING:
        return check_health(view, d, release, now, timers)
    if d.phase == pb.DEPLOYMENT_PHASE_PROMOTING:
        return promote_and_finish(d, env, now)
    return None


def stop_old(view: StateReader, d: pb.Deployment, now: float, timers: Timers) -> Decision | None:
    old = old_instances(view, d)
    running = [a for a in old if a.desired != STOP]
    if running:
        t = stay(d, f"stopping {len(running)} old instance(s)")
        t.puts = [with_desired(a, STOP, now=now) for a in running]
        t.events = [deploy_event(d, "deploy.maintenance_start", MAINTENANCE_START, WARNING, now)]
        return t
    alive = [a for a in old if a.observed.state not in GONE_STATES]
    if not alive:
        return move(d, pb.DEPLOYMENT_PHASE_STARTING, now)
    late = timers.overdue(d, now)
    if late is not None:
        first = alive[0]
        cause = f"the old instance {first.meta.id} on {first.node_id} is still {state_name(first.observed.state)}"
        return stateful_fail(view, d, f"{late}: {cause}", now)
    return None


def start_new(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, timers: Timers
) -> Decision | None:
    instances = green(view, d)
    if not instances:
        restoring = restoring_volume(view.volumes(env.meta.id))
        if restoring is not None:
            late = timers.overdue(d, now)
            if late is not None:
                return stateful_fail(view, d, f'{late}: volume "{restoring.name}" is still being restored', now)
            return None  # placed on the first pass after the restore ends (the loop ticks)
        picks, error = place(view, release, env.meta.id, 1)
        if not picks:
            return stateful_fail(view, d, NO_NODE_FOR_STATEFUL + (str(error) if error else "unknown"), now)
        node_id = picks[0]
        t = stay(d, f"starting the new instance on {node_id}")
        t.creates = [
            *missing_volumes(view, env, release, node_id, now),
            new_assignment(env, release, node_id, now=now, deployment_id=d.meta.id),
        ]
        return t
    if any(a.observed.state == pb.INSTANCE_STATE_FAILED for a in instances):
        return stateful_fail(view, d, failed_instance_reason(NEW_INSTANCE_FAILED_TO_START, instances), now)
    if all(a.observed.state in UP_STATES for a in instances):
        return move(d, pb.DEPLOYMENT_PHASE_HEALTHCHECKING, now)
    late = timers.overdue(d, now)
    if late is not None:
        first = instances[0]
        state = state_name(first.observed.state) if first.observed.state else "unreported"
        return stateful_fail(view, d, f"{late}: the new instance on {first.node_id} is still {state}", now)
    return None


def check_health(
    view: StateReader, d: pb.Deployment, release: pb.Release, now: float, timers: Timers
) -> Decision | None:
    instances = green(view, d)
    if any(a.observed.state == pb.INSTANCE_STATE_FAILED for a in instances):
        return stateful_fail(view, d, failed_instance_reason(NEW_INSTANCE_UNHEALTHY, instances), now)
    if instances and all(a.observed.state == pb.INSTANCE_STATE_HEALTHY for a in instances):
        return move(d, pb.DEPLOYMENT_PHASE_PROMOTING, now)
    entered = phase_entered_at(d)
    if entered is not None and now > entered + timers.health_deadline(release):
        return stateful_fail(view, d, NEW_INSTANCE_NOT_HEALTHY_IN_TIME, now)
    return None


def promote_and_finish(d: pb.Deployment, env: pb.Environment, now: float) -> Decision:
    """Traffic switch and SUCCEEDED in ONE write (no drain window: the old instance is already gone)."""
    t = move(d, pb.DEPLOYMENT_PHASE_SUCCEEDED, now)
    t.puts = [promoted_env(env, d.release_id)]
    t.events = [deploy_event(d, "deploy.maintenance_end", MAINTENANCE_END, INFO, now)]
    return t


def missing_volumes(
    view: StateReader, env: pb.Environment, release: pb.Release, node_id: str, now: float
) -> list[pb.Volume]:
    """Declared volumes that do not exist yet in (project, env), created pinned to the chosen node."""
    existing = {v.name for v in view.volumes(env.meta.id) if v.project_id == env.project_id}
    created: list[pb.Volume] = []
    for mount in release.service.volumes:
        if mount.volume_name in existing:
            continue
        existing.add(mount.volume_name)
        volume = pb.Volume(
            project_id=env.project_id,
            environment_id=env.meta.id,
            name=mount.volume_name,
            node_id=node_id,
            status=pb.VOLUME_STATUS_ACTIVE,
        )
        new_meta(volume.meta, now)
        created.append(volume)
    return created
