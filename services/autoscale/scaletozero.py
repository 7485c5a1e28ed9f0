"""ScaleToZero (``lease.scaletozero``): cools an idle ``scale_to_zero`` env to ``effective_replicas = 0``;
waking it again is the activator's job.

Per env: skip (timer untouched) unless scale-to-zero, not stateful, an active release and not serverless
(``max_concurrency > 0``: the serverless loop owns cooling); skip and forget the env's activity (so the
next eligible look grants a full window) while it is already cold or a deployment is under way and not
yet promoted (a promoted one keeps only its blue warm: cooling proceeds, and the orchestrator then stops
that blue too). Activity comes from fresh proxy samples (younger than 30 s): requests in flight or held
at a proxy mark the env active now (a woken env is not cooled while requests wait for it); otherwise the
newest ``last_request_at`` counts. The first sight of an env in a term grants a full idle window. Idle for
``idle_timeout`` (an env without one: ``ZATTERA_SCALE_TO_ZERO_IDLE_TIMEOUT``, 15 min) → cool, event
``scaletozero.cooled``; the activity timer and the event move only when the fenced write landed. No fresh
proxy data at all (an ingress blackout; a worker's heartbeat is no proxy data) freezes every decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from services.autoscale.common import Reading, ReplicaWrite, ScalingLoop, remember, scale_event, scaling_paused
from services.autoscale.settings import DEFAULTS
from shared.events import EVENT_COOLED
from shared.live import LiveView
from shared.loop import LoopDeps
from shared.settings import DEFAULTS as SHARED

log = logging.getLogger(__name__)

ACTOR = "system:scaletozero"


@dataclass(frozen=True, slots=True)
class Decision:
    """The write (if any) and the env's new last-active time (None = forget it)."""

    write: ReplicaWrite | None
    last_active: float | None
    reason: str


def idle_timeout(env: pb.Environment, default: float = DEFAULTS.scale_to_zero_idle_timeout) -> float:
    """The env's idle window in seconds (``default`` when unset or not positive)."""
    seconds = env.idle_timeout.seconds + env.idle_timeout.nanos / 1e9
    return seconds if seconds > 0 else default


def evaluate(
    at: Reading, last_active: float | None, *, default_idle_timeout: float = DEFAULTS.scale_to_zero_idle_timeout
) -> Decision:
    """Decide for one env from what it reads and its last-active time."""
    env, now = at.env, at.now
    spec = env.service
    if not spec.scale_to_zero or spec.stateful or not env.active_release_id or spec.max_concurrency > 0:
        return Decision(None, last_active, "not a scale-to-zero env this loop owns")
    if env.effective_replicas == 0:
        return Decision(None, None, "already cold")
    pause = scaling_paused(at.view, at.live, env.meta.id, from_proxy_data=True)
    if pause is not None:
        return Decision(None, None if pause.restarts_spell else last_active, pause.reason)
    traffic = at.live.env_traffic(env.meta.id)
    seen = now if last_active is None else last_active
    if traffic.inflight + traffic.held > 0:
        seen = now
    elif traffic.last_request_at > seen:
        seen = traffic.last_request_at
    if now - seen < idle_timeout(env, default_idle_timeout):
        return Decision(None, seen, "active within the idle window")
    return Decision(at.write(env.effective_replicas, 0), seen, "idle")


class ScaleToZero(ScalingLoop[float]):
    """``memory``: each env's last-active time."""

    name = "scaletozero"

    def __init__(
        self,
        deps: LoopDeps,
        *,
        live: LiveView,
        default_idle_timeout: float = DEFAULTS.scale_to_zero_idle_timeout,
        tick: float = SHARED.loop_tick,
    ) -> None:
        super().__init__(deps, live=live, tick=tick)
        self.default_idle_timeout = default_idle_timeout

    def decide(self, at: Reading) -> ReplicaWrite | None:
        decision = evaluate(at, self.memory.get(at.env.meta.id), default_idle_timeout=self.default_idle_timeout)
        remember(self.memory, at.env.meta.id, decision.last_active)
        return decision.write

    def committed(self, write: ReplicaWrite, now: float) -> pb.Event:
        message = f"scaled {write.env.name} to zero after idle"
        return scale_event(write, EVENT_COOLED, ACTOR, message, now, logger=log)
