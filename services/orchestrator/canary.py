"""The canary arm of the phase machine (issue 41, docs/deployments.md): between HEALTHCHECKING and
PROMOTING, a deployment whose release says ``strategy = "canary"`` sends a growing share of the traffic to
its green set, one step at a time:

    HEALTHCHECKING -> CANARY(step 0, 5 %) -> CANARY(step 1, 25 %) -> ... -> PROMOTING -> DRAINING_OLD
                      CANARY -(a bound broken, or an operator's abort)-> FAILED (green deleted, weight 0)

Where it is (step, weight, when the step began) is in the deployment record (``Deployment.canary``): the
route builder reads it to weight the routes, and a new leader resumes at the same step with the same
weights. Each decision is pure over the view, the time and the proxies' fresh heartbeats (their
per-release counters of the step, :func:`shared.canary.aggregate`); each is ONE fenced write of the
deployment (the abort also deletes the green set in the same batch).
"""

from __future__ import annotations

from collections.abc import Sequence

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import (
    GREEN_UNHEALTHY,
    abort,
    advance,
    blue,
    deploy_event,
    green_setback,
    phase_label,
)
from shared.canary import (
    ABORT,
    ABORTED_EVENT,
    PROMOTE,
    STEPPED_EVENT,
    Figures,
    Verdict,
    aggregate,
    canary_spec,
    judge,
    latency_ratio,
    step_tag,
)
from shared.clock import from_timestamp, stamp
from shared.decision import Decision
from shared.events import INFO, WARNING
from shared.state.reader import StateReader

CANARY = pb.DEPLOYMENT_PHASE_CANARY
PROMOTING = pb.DEPLOYMENT_PHASE_PROMOTING

ABORTED = "canary aborted"


def wants_canary(view: StateReader, d: pb.Deployment, env: pb.Environment, release: pb.Release) -> bool:
    """A canary runs when the release asks for one and there is a stable release serving beside it: not a
    first deploy, a rollback, a redeploy of the active release, nor a cold (scaled-to-zero) env."""
    if canary_spec(release) is None or d.is_rollback or not d.previous_release_id:
        return False
    if d.previous_release_id == d.release_id or env.active_release_id != d.previous_release_id:
        return False
    if env.service.scale_to_zero and env.effective_replicas == 0:
        return False
    return bool(blue(view, d))


def at_step(d: pb.Deployment, step: int, weight: int, now: float, *, phase: int = CANARY) -> pb.Deployment:
    nxt = advance(d, phase, now)
    nxt.canary.step = step
    nxt.canary.weight = weight
    stamp(nxt.canary.step_started_at, now)
    nxt.canary.requested = ""
    nxt.canary.requested_by = ""
    return nxt


def enter(d: pb.Deployment, release: pb.Release, now: float) -> Decision:
    """HEALTHCHECKING -> CANARY at the first step."""
    spec = canary_spec(release)
    assert spec is not None
    entered = at_step(d, 0, spec.steps[0], now)
    t = Decision(f"{phase_label(d.phase)}->CANARY step 0 ({spec.steps[0]}%)", fence=entered)
    t.events.append(_step_event(d, 0, spec.steps[0], "", now))
    return t


def tag_of(d: pb.Deployment) -> str:
    return step_tag(d.meta.id, d.canary.step)


def figures_of(d: pb.Deployment, proxies: Sequence[cpb.ProxyHeartbeat] | None) -> Figures:
    return aggregate(proxies or (), d.environment_id, tag_of(d), d.release_id, d.previous_release_id)


def pause_of(spec: pb.CanarySpec) -> float:
    return spec.pause.seconds + spec.pause.nanos / 1e9


def decide_canary(
    view: StateReader,
    d: pb.Deployment,
    env: pb.Environment,
    release: pb.Release,
    now: float,
    proxies: Sequence[cpb.ProxyHeartbeat] | None,
) -> Decision | None:
    """One step of a canary: an operator's request first, then the green set's health, then the analysis."""
    spec = canary_spec(release)
    if spec is None:  # the release lost its canary settings: finish as red/green would
        return Decision("CANARY->PROMOTING", fence=advance(d, PROMOTING, now))
    if d.canary.requested == ABORT:
        figures = figures_of(d, proxies)
        return canary_abort(view, d, spec, figures, judge(spec, figures), f"aborted by {d.canary.requested_by}", now)
    if d.canary.requested == PROMOTE:
        return Decision("CANARY->PROMOTING (operator)", fence=advance(d, PROMOTING, now))
    setback, _ = green_setback(view, d, env, release, now, GREEN_UNHEALTHY)
    if setback is not None:
        return setback
    figures = figures_of(d, proxies)
    verdict = judge(spec, figures)
    if verdict.breach:
        return canary_abort(view, d, spec, figures, verdict, verdict.breach, now)
    started = from_timestamp(d.canary.step_started_at)
    if now < started + pause_of(spec) or not verdict.enough:
        return None
    step = d.canary.step + 1
    if step >= len(spec.steps) or spec.steps[step] >= 100:
        promoted = advance(d, PROMOTING, now)
        promoted.canary.figures = verdict.summary
        return Decision(f"CANARY step {d.canary.step}->PROMOTING", fence=promoted)
    weight = spec.steps[step]
    nxt = at_step(d, step, weight, now)
    nxt.canary.figures = verdict.summary
    t = Decision(f"CANARY step {d.canary.step}->{step} ({weight}%)", fence=nxt)
    t.events.append(_step_event(d, step, weight, verdict.summary, now))
    return t


def canary_abort(
    view: StateReader,
    d: pb.Deployment,
    spec: pb.CanarySpec,
    figures: Figures,
    verdict: Verdict,
    reason: str,
    now: float,
) -> Decision:
    """ONE write: FAILED with the reason (the routes drop the weight: only a CANARY deployment is
    weighted) and the green set deleted; ``deployment.canary_aborted`` carries the figures vs the bounds."""
    error = f"{ABORTED} at step {d.canary.step} ({d.canary.weight}%): {reason}"
    t = abort(view, d, error, now)
    failed = t.fence
    assert isinstance(failed, pb.Deployment)
    failed.canary.figures = verdict.summary
    event = deploy_event(d, ABORTED_EVENT, f"{error} — {verdict.summary}", WARNING, now)
    canary = figures.canary
    event.fields.update(
        {
            "step": str(d.canary.step),
            "weight": str(d.canary.weight),
            "reason": reason,
            "trigger": "operator" if d.canary.requested == ABORT else "analysis",
            "requests": str(canary.requests),
            "min_requests": str(spec.min_requests),
            "errors_5xx": str(canary.errors),
            "error_ratio": f"{canary.error_ratio:.4f}",
            "max_error_ratio": f"{spec.max_error_ratio:g}",
            "latency_ms": f"{canary.latency_ms:g}",
            "latency_kind": canary.latency_kind,
            "stable_latency_ms": f"{figures.stable.latency_ms:g}",
            "latency_ratio": f"{latency_ratio(figures):.2f}",
            "max_latency_ratio": f"{spec.max_latency_ratio:g}",
            "release_id": d.release_id,
        }
    )
    t.events.insert(0, event)
    return t


def _step_event(d: pb.Deployment, step: int, weight: int, figures: str, now: float) -> pb.Event:
    message = f"canary step {step}: {weight}% of the traffic to the new release"
    event = deploy_event(d, STEPPED_EVENT, message, INFO, now)
    event.fields.update({"step": str(step), "weight": str(weight), "figures": figures, "release_id": d.release_id})
    return event


def wake_at(d: pb.Deployment, release: pb.Release | None) -> float | None:
    """The end of the step's pause (then only heartbeats and changes matter)."""
    spec = canary_spec(release) if release is not None else None
    if spec is None or not d.canary.HasField("step_started_at"):
        return None
    return from_timestamp(d.canary.step_started_at) + pause_of(spec)
