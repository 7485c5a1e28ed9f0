"""Autoscaler (``lease.autoscaler``): resource-based ``effective_replicas`` from CPU, memory and RPS.

Per env, in this order: a target > 0 and an active release; not serverless
(``max_concurrency == 0``); no deployment under way before its promotion (a draining one holds only its
blue); room to scale (``max > max(min, 1)``); fresh observations of at least one running replica (else
freeze). The candidate per signal is ``ceil(replicas × observed / (target × band))`` (RPS:
``ceil(total_rps / (target × band))``), the max of the candidates clamped to ``[max(min, 1), max]``.
Scale up at once; scale down only when even the 0.8 band says so for 5 continuous minutes; 3 minutes of
cooldown after any write, both ways. The hold and cooldown timers live in memory and reset at every
term.

Only samples younger than 30 s count (a dead node's last sample does not count forever); cooldown and
events are recorded only for a write that landed; the write is fenced on the env's revision. It reacts to
each fresh sample as it arrives, not only every 15 s.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from services.autoscale.common import Reading, ReplicaWrite, ScalingLoop, remember, scale_event, scaling_paused
from shared import keys as K
from shared.deployments import desired_replicas as current_replicas
from shared.events import replica_count
from shared.live import ENV_TRAFFIC, INSTANCE, LiveView
from shared.loop import LoopDeps
from shared.settings import DEFAULTS
from shared.state.reader import StateReader
from shared.state.tables import RUN

log = logging.getLogger(__name__)

ACTOR = "system:autoscaler"
EVENT_SCALED = "autoscale.scaled"
SCALE_DOWN_HOLD = 300.0
COOLDOWN = 180.0
DOWN_BAND = 0.8
MIB = 1_048_576


@dataclass(frozen=True, slots=True)
class Observation:
    """Aggregated fresh samples of an env's running replicas; ``avg_mem`` is None without a memory limit."""

    replicas: int
    avg_cpu: float
    avg_mem: float | None
    total_rps: float


@dataclass(slots=True)
class Timers:
    """The loop's per-env memory: when the env became a scale-down candidate, and its last write."""

    low_since: dict[str, float] = field(default_factory=dict)
    last_change: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """What one evaluation concluded: the write (if any) and the new hold timer (None = cleared)."""

    write: ReplicaWrite | None
    low_since: float | None
    reason: str


def observe(view: StateReader, live: LiveView, env: pb.Environment) -> Observation | None:
    """Fresh samples of the env's running replicas (any release, RUN, not a job); None = freeze."""
    mem_limit = env.service.resources.memory_mb * MIB
    replicas = 0
    cpu_sum = mem_sum = 0.0
    for a in view.assignments(env.meta.id):
        if a.job_id or a.desired != RUN:
            continue
        sample = live.fresh_instance_sample(a.meta.id, prefer_node=a.node_id)
        if sample is None:
            continue
        replicas += 1
        cpu_sum += sample.cpu_percent
        if mem_limit > 0:
            mem_sum += sample.memory_bytes / mem_limit * 100
    if replicas == 0:
        return None
    return Observation(
        replicas=replicas,
        avg_cpu=cpu_sum / replicas,
        avg_mem=mem_sum / replicas if mem_limit > 0 else None,
        total_rps=live.env_traffic(env.meta.id).rps,
    )


def scale_target(targets: pb.Autoscale, obs: Observation, min_rep: int, max_rep: int, band: float) -> int:
    """The max of the per-signal candidates, clamped to the bounds."""
    desired = min_rep
    if targets.target_cpu_percent > 0:
        desired = max(desired, math.ceil(obs.replicas * obs.avg_cpu / (targets.target_cpu_percent * band)))
    if targets.target_memory_percent > 0 and obs.avg_mem is not None:
        desired = max(desired, math.ceil(obs.replicas * obs.avg_mem / (targets.target_memory_percent * band)))
    if targets.target_rps_per_replica > 0:
        desired = max(desired, math.ceil(obs.total_rps / (targets.target_rps_per_replica * band)))
    return max(min_rep, min(desired, max_rep))


def has_targets(targets: pb.Autoscale) -> bool:
    return targets.target_cpu_percent > 0 or targets.target_memory_percent > 0 or targets.target_rps_per_replica > 0


def evaluate(at: Reading, timers: Timers, *, hold: float = SCALE_DOWN_HOLD, cooldown: float = COOLDOWN) -> Decision:
    """Decide for one env from what it reads and the timers (reads only)."""
    env, now = at.env, at.now
    env_id = env.meta.id
    low_since = timers.low_since.get(env_id)
    spec = env.service
    if not (has_targets(spec.autoscale) and env.active_release_id):
        return Decision(None, low_since, "no autoscale target or no active release")
    if spec.max_concurrency > 0:
        return Decision(None, low_since, "serverless env (the serverless loop owns it)")
    pause = scaling_paused(at.view, at.live, env_id, from_proxy_data=False)
    if pause is not None:
        return Decision(None, low_since, pause.reason)  # its low spell is kept through a pause
    min_rep = max(spec.replicas.min, 1)
    max_rep = spec.replicas.max
    if max_rep <= min_rep:
        return Decision(None, low_since, "no room to scale")
    obs = observe(at.view, at.live, env)
    if obs is None:
        return Decision(None, low_since, "no fresh samples of running replicas (frozen)")

    effective = current_replicas(env)
    if effective < 1:
        effective = min_rep
    desired = scale_target(spec.autoscale, obs, min_rep, max_rep, 1.0)
    last_change = timers.last_change.get(env_id)
    cooling = last_change is not None and now - last_change < cooldown
    write = at.write(effective, desired)
    if desired > effective:
        return Decision(None if cooling else write, None, "cooldown" if cooling else "scale up")
    if desired == effective:
        return Decision(None, None, "at target")
    if scale_target(spec.autoscale, obs, min_rep, max_rep, DOWN_BAND) >= effective:
        return Decision(None, None, "within the down band")
    since = now if low_since is None else low_since
    if now - since < hold:
        return Decision(None, since, "scale-down hold")
    if cooling:
        return Decision(None, since, "cooldown")
    return Decision(write, since, "scale down")


class Autoscaler(ScalingLoop[None]):
    """Its per-env timing is :attr:`timers` (a hold and a cooldown), not ``memory``."""

    name = "autoscaler"
    kinds = frozenset({K.ENV, K.DEPLOYMENT, K.ASSIGNMENT})
    live_kinds = frozenset({ENV_TRAFFIC, INSTANCE})

    def __init__(
        self,
        deps: LoopDeps,
        *,
        live: LiveView,
        hold: float = SCALE_DOWN_HOLD,
        cooldown: float = COOLDOWN,
        tick: float = DEFAULTS.loop_tick,
    ) -> None:
        super().__init__(deps, live=live, tick=tick)
        self.hold = hold
        self.cooldown = cooldown
        self.timers = Timers()

    def on_term_start(self) -> None:
        # A new term: the hold restarts (conservative) and the cooldown is cleared.
        self.timers = Timers()

    def decide(self, at: Reading) -> ReplicaWrite | None:
        decision = evaluate(at, self.timers, hold=self.hold, cooldown=self.cooldown)
        remember(self.timers.low_since, at.env.meta.id, decision.low_since)
        return decision.write

    def committed(self, write: ReplicaWrite, now: float) -> pb.Event:
        self.timers.last_change[write.env_id] = now
        self.timers.low_since.pop(write.env_id, None)
        message = f"autoscaled {write.env.name} from {write.current} to {replica_count(write.target)}"
        return scale_event(write, EVENT_SCALED, ACTOR, message, now, logger=log)
