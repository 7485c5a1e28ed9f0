"""The deployment phase machine as pure decisions: ``decide(view, deployment, now, timers)``.

Each call advances one deployment by at most one step and returns the :class:`Decision` to commit
(or None). Guards first (terminal, env/release missing, superseded, operator cancel), then the
stateful arm (:mod:`services.orchestrator.stateful`) or the red/green arm below:

    PENDING -+-(build_id, no image)-> BUILDING -(build ok)-> [RELEASING ->] PLACING
             +-(rollback, warm)------------------------------------> PROMOTING
             +---------------------------------------------------> [RELEASING ->] PLACING -> STARTING -> ...
    STARTING -> HEALTHCHECKING -> PROMOTING

(RELEASING: the env's release command, when it has one, :mod:`services.orchestrator.release`.)
    PROMOTING -> DRAINING_OLD -> SUCCEEDED   (PROMOTING -> SUCCEEDED when there is nothing to drain)

Rules, each pinned by a test:
* abort, promotion, placement+phase, stamp+phase are each ONE write (no crash leaves half a transition);
* an empty or short green set is never "ready" when the target count is above zero;
* every waiting phase has a timeout (BUILDING, PLACING, STARTING, STOPPING_OLD) naming phase and cause;
* a green replica on a lost node (DOWN, DRAINED, deleted) is deleted and re-placed before promotion;
* placement does not exclude nodes already holding green: the placer's spread score already prefers
  nodes with fewer replicas of the env, and excluding them could leave PLACING stuck on small clusters;
* draining a deployment whose target is its own previous release (a rollback to the active release, a
  redeploy) never stops below the target count of live replicas.
"""

from __future__ import annotations

from collections.abc import Sequence

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.orchestrator.canary import CANARY, decide_canary, wants_canary
from services.orchestrator.canary import enter as enter_canary
from services.orchestrator.canary import wake_at as canary_wake_at
from services.orchestrator.model import (
    BUILD_FAILED,
    BUILD_NOT_FOUND,
    BUILD_PRODUCED_NO_IMAGE,
    ENV_NOT_FOUND,
    GREEN_FAILED_TO_START,
    GREEN_NOT_HEALTHY_IN_TIME,
    GREEN_UNHEALTHY,
    NO_IMAGE,
    RELEASE_NOT_FOUND,
    RUN,
    STOP,
    SUPERSEDED,
    UP_STATES,
    Timers,
    abort,
    blue,
    copy_of,
    deployment_of,
    green,
    green_setback,
    move,
    observed_summary,
    on_live_nodes,
    outcome_events,
    phase_entered_at,
    promoted_env,
    stateful_fail,
    stay,
    tagged,
    with_transition_ids,
)
from services.orchestrator.release import RELEASING, cancel_with, needs_release_phase, releasing
from services.orchestrator.stateful import decide_stateful
from shared import keys as K
from shared.clock import from_timestamp
from shared.decision import Decision
from shared.deploy import CANCELED_BY_OPERATOR, cancel_requested
from shared.deployments import is_terminal
from shared.placement.placement import place
from shared.placement.replicas import deploy_replicas, new_assignment, with_desired
from shared.state.reader import StateReader

PENDING = pb.DEPLOYMENT_PHASE_PENDING
BUILDING = pb.DEPLOYMENT_PHASE_BUILDING
PLACING = pb.DEPLOYMENT_PHASE_PLACING
STARTING = pb.DEPLOYMENT_PHASE_STARTING
HEALTHCHECKING = pb.DEPLOYMENT_PHASE_HEALTHCHECKING
PROMOTING = pb.DEPLOYMENT_PHASE_PROMOTING
DRAINING_OLD = pb.DEPLOYMENT_PHASE_DRAINING_OLD
STOPPING_OLD = pb.DEPLOYMENT_PHASE_STOPPING_OLD

# A strict "now > deadline" becomes true just after the deadline: wake a hair later.
STRICT_WAKE_EPSILON = 0.001


def decide(
    view: StateReader,
    d: pb.Deployment,
    now: float,
    timers: Timers,
    proxies: Sequence[cpb.ProxyHeartbeat] | None = None,
    nodes: Sequence[cpb.Heartbeat] = (),
) -> Decision | None:
    """The next step of deployment ``d`` (None: nothing to do until something changes), with the events
    it announces, each named after the deployment's revision the step was decided on. ``proxies``: the
    live proxies' fresh heartbeats (None: not known, the old release is kept for the whole drain window);
    ``nodes``: the nodes' fresh heartbeats (their private-network forwarders' counts)."""
    t = next_step(view, d, now, timers, proxies, nodes)
    if t is not None:
        cancel_with(view, d, t, now)
        release = view.release(d.release_id)
        label = f"v{release.version}" if release is not None and release.version else ""
        t.events.extend(outcome_events(d, deployment_of(t), now, label))
        with_transition_ids(d, t.events, view.rev(K.deployment(d.meta.id)))
    return t


def next_step(
    view: StateReader,
    d: pb.Deployment,
    now: float,
    timers: Timers,
    proxies: Sequence[cpb.ProxyHeartbeat] | None,
    nodes: Sequence[cpb.Heartbeat],
) -> Decision | None:
    if is_terminal(d.phase):
        return None
    env = view.env(d.environment_id)
    if env is None:
        return abort(view, d, ENV_NOT_FOUND, now)
    release = view.release(d.release_id)
    if release is None:
        return abort(view, d, RELEASE_NOT_FOUND, now)
    if superseded(view, d):
        return supersede(view, d, now)
    stateful = release.service.stateful
    if cancel_requested(d) and d.phase != DRAINING_OLD:
        if stateful and d.phase not in (PENDING, BUILDING):
            return stateful_fail(view, d, CANCELED_BY_OPERATOR, now)
        return abort(view, d, CANCELED_BY_OPERATOR, now)
    if d.phase == PENDING:
        return pending(view, d, env, release, now, first_step=STOPPING_OLD if stateful else PLACING)
    if d.phase == BUILDING:
        return building(view, d, release, now, timers, next_phase=STOPPING_OLD if stateful else PLACING)
    if d.phase == RELEASING:
        return releasing(view, d, release, now, timers, next_phase=STOPPING_OLD if stateful else PLACING)
    if stateful:
        return decide_stateful(view, d, env, release, now, timers)
    return decide_red_green(view, d, env, release, now, timers, proxies, nodes)


# ---------------------------------------------------------------------- guards


def newer(a: pb.Deployment, b: pb.Deployment) -> bool:
    """deploymentNewer: later created_at, ties (including both unset) broken by the larger id."""
    ta, tb = a.meta.created_at.ToNanoseconds(), b.meta.created_at.ToNanoseconds()
    if ta != tb:
        return ta > tb
    return a.meta.id > b.meta.id


def superseded(view: StateReader, d: pb.Deployment) -> bool:
    return any(
        o.meta.id != d.meta.id and not is_terminal(o.phase) and newer(o, d) for o in view.deployments(d.environment_id)
    )


def supersede(view: StateReader, d: pb.Deployment, now: float) -> Decision:
    """A newer deployment owns the env. A promoted one just completes: its green is the live release and
    its blue stays warm (the newer one may be a rollback to exactly that release)."""
    if d.phase == DRAINING_OLD:
        return move(d, pb.DEPLOYMENT_PHASE_SUCCEEDED, now)
    t = move(d, pb.DEPLOYMENT_PHASE_SUPERSEDED, now, error=SUPERSEDED)
    t.deletes = [K.assignment(a.node_id, a.meta.id) for a in tagged(view, d)]
    return t


# ---------------------------------------------------------------------- shared by both machines


def pending(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, *, first_step: int
) -> Decision:
    if d.build_id and not release.image_ref:
        return move(d, BUILDING, now)
    if not release.image_ref:
        return abort(view, d, NO_IMAGE, now)
    if first_step == PLACING and d.is_rollback and warm_enough(view, env, release):
        return move(d, PROMOTING, now)
    return move(d, RELEASING if needs_release_phase(d, release) else first_step, now)


def warm_enough(view: StateReader, env: pb.Environment, release: pb.Release) -> bool:
    """A rollback may promote at once when enough healthy replicas of its target still run (any tag)."""
    want = deploy_replicas(env, release)
    if want <= 0:
        return False
    warm = [
        a
        for a in view.assignments(env.meta.id)
        if a.release_id == release.meta.id and a.desired == RUN and a.observed.state == pb.INSTANCE_STATE_HEALTHY
    ]
    live, _ = on_live_nodes(view, warm)
    return len(live) >= want


def building(
    view: StateReader, d: pb.Deployment, release: pb.Release, now: float, timers: Timers, *, next_phase: int
) -> Decision | None:
    build = view.build(d.build_id)
    if build is None:
        return abort(view, d, BUILD_NOT_FOUND, now)
    if build.status == pb.BUILD_STATUS_SUCCEEDED:
        if not build.image_ref:
            return abort(view, d, BUILD_PRODUCED_NO_IMAGE, now)
        t = move(d, RELEASING if needs_release_phase(d, release) else next_phase, now)
        if release.image_ref != build.image_ref:
            stamped = copy_of(release)
            stamped.image_ref = build.image_ref
            stamped.platforms[:] = list(build.platforms)
            t.puts = [stamped]
        return t
    if build.status in (pb.BUILD_STATUS_FAILED, pb.BUILD_STATUS_CANCELED):
        return abort(view, d, BUILD_FAILED + build.error, now)
    late = timers.overdue(d, now)
    if late is not None:
        status = pb.BuildStatus.Name(build.status).removeprefix("BUILD_STATUS_")
        return abort(view, d, f"{late}: build {build.meta.id} is still {status}", now)
    return None


# ---------------------------------------------------------------------- red/green


def decide_red_green(
    view: StateReader,
    d: pb.Deployment,
    env: pb.Environment,
    release: pb.Release,
    now: float,
    timers: Timers,
    proxies: Sequence[cpb.ProxyHeartbeat] | None,
    nodes: Sequence[cpb.Heartbeat],
) -> Decision | None:
    if d.phase == PLACING:
        return placing(view, d, env, release, now, timers)
    if d.phase in GREEN_FAILURES:
        return green_coming_up(view, d, env, release, now, timers)
    if d.phase == PROMOTING:
        return promote(view, d, env, release, now, timers)
    if d.phase == DRAINING_OLD:
        return drain(view, d, env, release, now, proxies=proxies, nodes=nodes, quiet=timers.drain_quiet)
    if d.phase == CANARY:
        return decide_canary(view, d, env, release, now, proxies)
    return None


def placing(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, timers: Timers
) -> Decision | None:
    """Place the missing green replicas; STARTING in the same write once the set is complete."""
    target = deploy_replicas(env, release)
    live, lost = on_live_nodes(view, green(view, d))
    drop = [K.assignment(a.node_id, a.meta.id) for a in lost]
    need = target - len(live)
    if need <= 0:
        t = move(d, STARTING, now)
        t.deletes = drop
        return t
    picks, error = place(view, release, env.meta.id, need)
    late = timers.overdue(d, now)
    if late is not None:
        return abort(view, d, f"{late}: placed {len(live)} of {target} green replicas: {error or 'no capacity'}", now)
    if not picks and not drop:
        return None
    if len(picks) == need:
        t = move(d, STARTING, now)
    else:
        t = stay(d, f"placed {len(live) + len(picks)} of {target} green replicas")
    t.creates = [new_assignment(env, release, node_id, now=now, deployment_id=d.meta.id) for node_id in picks]
    t.deletes = drop
    return t


GREEN_FAILURES = {STARTING: GREEN_FAILED_TO_START, HEALTHCHECKING: GREEN_UNHEALTHY}
"""The phases of a green set on its way up, and what a failed green instance aborts them with."""


def green_coming_up(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, timers: Timers
) -> Decision | None:
    """STARTING and HEALTHCHECKING: a setback of the green set first (a failed instance aborts, a lost or
    missing replica sends it back to placing); then STARTING waits for every green replica to run, and
    HEALTHCHECKING for every one to be healthy."""
    setback, live = green_setback(view, d, env, release, now, GREEN_FAILURES[d.phase])
    if setback is not None:
        return setback
    if d.phase == STARTING:
        if all(a.observed.state in UP_STATES for a in live):
            return move(d, HEALTHCHECKING, now)
        late = timers.overdue(d, now)
        if late is not None:
            waiting = [a for a in live if a.observed.state not in UP_STATES]
            cause = f"{len(waiting)} of {len(live)} green instances not running ({observed_summary(waiting)})"
            return abort(view, d, f"{late}: {cause}", now)
        return None
    if all(a.observed.state == pb.INSTANCE_STATE_HEALTHY for a in live):
        if wants_canary(view, d, env, release):
            return enter_canary(d, release, now)
        return move(d, PROMOTING, now)
    entered = phase_entered_at(d)
    if entered is not None and now > entered + timers.health_deadline(release):
        return abort(view, d, GREEN_NOT_HEALTHY_IN_TIME, now)
    return None


def promote(
    view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release, now: float, timers: Timers
) -> Decision:
    """ONE write: active release + route generation, and DRAINING_OLD with promoted_at and drain_deadline
    — or SUCCEEDED at once when there is nothing to drain (a first deploy, a cold env): no blue is held,
    so nothing waits on the window."""
    if nothing_to_drain(view, d, env, release):
        t = move(d, pb.DEPLOYMENT_PHASE_SUCCEEDED, now, promoted_at=now)
    else:
        t = move(d, DRAINING_OLD, now, promoted_at=now, drain_deadline=now + timers.drain_window)
    t.puts = [promoted_env(env, d.release_id)]
    return t


def nothing_to_drain(view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release) -> bool:
    """No blue replica to keep warm, or the env is cold (cooled to zero: its blue stops with it)."""
    return not blue_to_stop(view, d, env, release) or env_is_cold(env)


def env_is_cold(env: pb.Environment) -> bool:
    return env.service.scale_to_zero and env.effective_replicas == 0


def drain(
    view: StateReader,
    d: pb.Deployment,
    env: pb.Environment,
    release: pb.Release,
    now: float,
    *,
    proxies: Sequence[cpb.ProxyHeartbeat] | None = None,
    nodes: Sequence[cpb.Heartbeat] = (),
    quiet: float = 0.0,
) -> Decision | None:
    """Stop blue and succeed, in one write: after the drain window, or as soon as there is nothing left to
    keep warm (blue gone), the env cooled to zero (its warm blue cools with it), or nothing is in flight to
    blue any more (:func:`drained`). Green is never touched."""
    window_open = d.HasField("drain_deadline") and now < from_timestamp(d.drain_deadline)
    if window_open and not nothing_to_drain(view, d, env, release) and not drained(view, d, env, proxies, nodes, quiet):
        return None
    t = move(d, pb.DEPLOYMENT_PHASE_SUCCEEDED, now)
    t.puts = [with_desired(a, STOP, now=now) for a in blue_to_stop(view, d, env, release)]
    return t


def drained(
    view: StateReader,
    d: pb.Deployment,
    env: pb.Environment,
    proxies: Sequence[cpb.ProxyHeartbeat] | None,
    nodes: Sequence[cpb.Heartbeat],
    quiet: float,
) -> bool:
    """Whether the old release has nothing in flight any more, so its drain may end before the window.

    True only when there is at least one live proxy and EVERY one of them (the fresh heartbeats given)
    reported, in a sample taken at least ``quiet`` seconds after the promotion,
    that it routes by a route version that includes the promotion (``routes_version`` ≥ the env's
    revision: the snapshot version is the newest state revision it was built from), that its counts are
    complete (``drain_counts``: no HAProxy worker from before a reload still holding connections), and
    that it has nothing in flight to an endpoint its routes no longer list for this env (``old_inflight``).
    A proxy that has not reported since then, an older proxy, a WebSocket or a long request still open:
    the old release is kept (at the latest until the drain window ends). An env with declared ports is
    reachable over the private network too: then every node's heartbeat (``nodes``, fresh) must likewise
    report, from its forwarder, a snapshot version including the promotion and no connection open to an
    endpoint no longer listed (a node without a forwarder, or an older agent, keeps it).
    (An env re-written after the promotion without a route change, e.g. scaled, raises its revision above
    the snapshot versions: blue is then kept until the routes change again or the window ends — late, never
    early.)"""
    if not proxies or not d.HasField("promoted_at"):
        return False
    promoted_at = from_timestamp(d.promoted_at)
    env_revision = view.rev(K.env(env.meta.id))
    if not env_revision:
        return False
    for heartbeat in proxies:
        sampled_at = from_timestamp(heartbeat.time)
        if sampled_at < promoted_at + quiet:
            return False
        if not heartbeat.drain_counts or heartbeat.routes_version < env_revision:
            return False
        if heartbeat.old_inflight.get(env.meta.id, 0) > 0:
            return False
    if env.service.ports:
        if not nodes:
            return False
        for node_heartbeat in nodes:
            if from_timestamp(node_heartbeat.time) < promoted_at + quiet:
                return False
            if not node_heartbeat.forwarder_counts or node_heartbeat.forwarder_routes_version < env_revision:
                return False
            if node_heartbeat.forwarder_old_connections.get(env.meta.id, 0) > 0:
                return False
    return True


def blue_to_stop(view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release) -> list[pb.Assignment]:
    """blue(d), except when the target is the previous release itself (a rollback to the active release,
    a redeploy): then blue is the live set, so keep the target count running — d's own replicas first,
    then the newest others — and stop only the oldest surplus."""
    candidates = blue(view, d)
    if d.release_id != d.previous_release_id:
        return candidates
    own = sum(1 for a in green(view, d) if a.release_id == d.release_id)
    keep = max(0, deploy_replicas(env, release) - own)
    surplus = len(candidates) - keep
    return candidates[: max(0, surplus)]


# ---------------------------------------------------------------------- timers


def wake_at(view: StateReader, d: pb.Deployment, timers: Timers) -> float | None:
    """The instant at which time alone can change ``decide`` for ``d`` (None: only a change can)."""
    if is_terminal(d.phase):
        return None
    if d.phase == DRAINING_OLD:
        return from_timestamp(d.drain_deadline) if d.HasField("drain_deadline") else None
    if d.phase == CANARY:
        return canary_wake_at(d, view.release(d.release_id))
    entered = phase_entered_at(d)
    if entered is None:
        return None
    if d.phase == HEALTHCHECKING:
        release = view.release(d.release_id)
        if release is None:
            return None
        return entered + timers.health_deadline(release) + STRICT_WAKE_EPSILON
    limit = timers.phase_timeout(d.phase)
    return None if limit is None else entered + limit + STRICT_WAKE_EPSILON
