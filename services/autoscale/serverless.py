"""Serverless (``lease.serverless``): concurrency-based ``effective_replicas`` for every env with
``max_concurrency > 0`` and an active release; the autoscaler and the scale-to-zero loop leave these envs
alone. Skips while a deployment is under way; no fresh proxy data (samples younger than 30 s) freezes.

``desired = ceil((in_flight + held) / max_concurrency)`` clamped to ``[floor, ceiling]``: floor 0 for a
scale-to-zero env, else max(min, 1); ceiling max(max, max(min, 1)), never below the wake target (so
``min = 0`` without ``max`` does not pin a scale-to-zero env at 0, undoing every wake).

* Requests held at proxies count as demand: a wake is never undone while requests wait, and load queued
  behind the per-replica cap drives scale-up (in-flight alone can never exceed replicas × cap).
* Scale up at once; scale down only after demand has stayed below the current count for
  ``scale_down_window`` (``ZATTERA_SERVERLESS_SCALE_DOWN_WINDOW``, 30 s), and then only to the highest
  count demand asked for during that window, so gappy traffic does not cold-start over and over.
* The write is fenced on the env's revision.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from services.autoscale.common import (
    Reading,
    ReplicaWrite,
    ScalingLoop,
    remember,
    scale_event,
    scaling_paused,
    wake_target,
)
from services.autoscale.settings import DEFAULTS
from shared.deployments import desired_replicas as current_replicas
from shared.events import replica_count
from shared.live import LiveView
from shared.loop import LoopDeps

log = logging.getLogger(__name__)

ACTOR = "system:serverless"
EVENT_SCALED = "serverless.scaled"


@dataclass(frozen=True, slots=True)
class LowSpell:
    """Demand has asked for fewer than ``current`` replicas since ``since``; ``peak`` is the most it asked."""

    since: float
    current: int
    peak: int


@dataclass(frozen=True, slots=True)
class Decision:
    write: ReplicaWrite | None
    low: LowSpell | None
    reason: str


def replica_bounds(env: pb.Environment) -> tuple[int, int]:
    """(floor, ceiling) of a serverless env."""
    floor = 0 if env.service.scale_to_zero else wake_target(env)
    return floor, max(env.service.replicas.max, wake_target(env))


def desired_replicas(demand: int, max_concurrency: int, floor: int, ceiling: int) -> int:
    return max(floor, min(math.ceil(demand / max_concurrency), ceiling))


def evaluate(at: Reading, low: LowSpell | None, *, window: float = DEFAULTS.serverless_scale_down_window) -> Decision:
    """Decide for one env from what it reads and its low spell (reads only)."""
    env, now = at.env, at.now
    spec = env.service
    if spec.max_concurrency == 0 or not env.active_release_id:
        return Decision(None, low, "not a serverless env")
    pause = scaling_paused(at.view, at.live, env.meta.id, from_proxy_data=True)
    if pause is not None:
        return Decision(None, None if pause.restarts_spell else low, pause.reason)
    traffic = at.live.env_traffic(env.meta.id)
    floor, ceiling = replica_bounds(env)
    desired = desired_replicas(traffic.inflight + traffic.held, spec.max_concurrency, floor, ceiling)
    current = current_replicas(env)
    if desired > current:
        return Decision(at.write(current, desired), None, "scale up")
    if desired == current:
        return Decision(None, None, "at target")
    if low is None or low.current != current:
        low = LowSpell(now, current, desired)
    else:
        low = LowSpell(low.since, current, max(low.peak, desired))
    if now - low.since < window:
        return Decision(None, low, "scale-down window")
    return Decision(at.write(current, low.peak), low, "scale down")


class Serverless(ScalingLoop[LowSpell]):
    """``memory``: each env's low spell."""

    name = "serverless"

    def __init__(
        self,
        deps: LoopDeps,
        *,
        live: LiveView,
        scale_down_window: float = DEFAULTS.serverless_scale_down_window,
        tick: float = DEFAULTS.serverless_tick,
    ) -> None:
        super().__init__(deps, live=live, tick=tick)
        self.window = scale_down_window

    def decide(self, at: Reading) -> ReplicaWrite | None:
        decision = evaluate(at, self.memory.get(at.env.meta.id), window=self.window)
        remember(self.memory, at.env.meta.id, decision.low)
        return decision.write

    def committed(self, write: ReplicaWrite, now: float) -> pb.Event:
        message = f"serverless scaled {write.env.name} from {write.current} to {replica_count(write.target)}"
        return scale_event(write, EVENT_SCALED, ACTOR, message, now, logger=log)
