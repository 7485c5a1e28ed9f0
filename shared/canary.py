"""Canary releases (issue 41, docs/deployments.md): the defaults of ``strategy = "canary"``, the step tags
and weights the route builder writes, the per-release latency histogram the proxies keep, and the
analysis of one step — aggregated across proxies, judged against the bounds. Pure: the orchestrator's
canary phase, ``zattera deploy watch`` and the console compute the same figures from the same heartbeats.

A proxy counts, for each weighted route's endpoint release and step tag (``<deployment id>.<step>``), the
requests, the 5xx answers and a latency histogram (:data:`LATENCY_BOUNDS_MS`), from the moment the tag
appears in its routes; its heartbeat carries them (``ProxyHeartbeat.release_traffic``). The sum over the
live proxies' fresh heartbeats is the step's figures. A proxy that restarts mid-step starts its counts
over (the step then needs more requests to be judged: late, never early).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

CANARY_DEFAULT_STEPS = (5, 25, 50, 100)
CANARY_DEFAULT_PAUSE = 60.0
CANARY_DEFAULT_MAX_ERROR_RATIO = 0.01
CANARY_DEFAULT_MAX_LATENCY_RATIO = 1.5
CANARY_DEFAULT_MIN_REQUESTS = 100

LATENCY_BOUNDS_MS: tuple[float, ...] = (
    1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000,
)  # fmt: skip
"""Upper bounds (ms, inclusive) of the latency histogram's buckets; one more bucket counts the rest."""

LATENCY_FLOOR_MS = 50.0
"""Below this p99 the new release's latency is never a breach: the buckets' own width (up to 1.5x) would
make a 4 ms vs 6 ms difference look like a regression."""

BASIS_POINTS = 10_000

PROMOTE = "promote"
ABORT = "abort"

ABORTED_EVENT = "deployment.canary_aborted"
STEPPED_EVENT = "deployment.canary_step"


def step_tag(deployment_id: str, step: int) -> str:
    """What proxies key a step's counters by: a new tag per step starts the counts afresh."""
    return f"{deployment_id}.{step}"


def bucket_of(latency_ms: float) -> int:
    """The histogram bucket of one latency (len(LATENCY_BOUNDS_MS) = above the last bound)."""
    return bisect_left(LATENCY_BOUNDS_MS, latency_ms)


def percentile_ms(buckets: Sequence[int], q: float = 0.99) -> float:
    """The ``q`` quantile of a histogram as its bucket's upper bound (the overflow bucket: twice the last
    bound); 0 when empty."""
    total = sum(buckets)
    if total <= 0:
        return 0.0
    rank = q * total
    seen = 0
    for index, count in enumerate(buckets):
        seen += count
        if seen >= rank and count:
            return LATENCY_BOUNDS_MS[index] if index < len(LATENCY_BOUNDS_MS) else 2 * LATENCY_BOUNDS_MS[-1]
    return 2 * LATENCY_BOUNDS_MS[-1]


def add_buckets(into: list[int], more: Iterable[int]) -> None:
    for index, count in enumerate(more):
        if index >= len(into):
            into.extend([0] * (index + 1 - len(into)))
        into[index] += count


def release_weights(weight_percent: int) -> tuple[int, int]:
    """(stable, canary) shares of a weighted route in basis points."""
    canary = max(0, min(100, weight_percent)) * 100
    return BASIS_POINTS - canary, canary


@dataclass(frozen=True, slots=True)
class Side:
    """One release's traffic during a step, summed over the proxies."""

    requests: int = 0
    errors: int = 0
    buckets: tuple[int, ...] = ()
    avg_ms: float = 0.0
    """Request-weighted average of the proxies that keep no histogram (HAProxy)."""

    @property
    def error_ratio(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def latency_ms(self) -> float:
        """p99 from the histogram; the average when the proxies kept none (HAProxy)."""
        return percentile_ms(self.buckets) if sum(self.buckets) else self.avg_ms

    @property
    def latency_kind(self) -> str:
        return "p99" if sum(self.buckets) else "avg"


@dataclass(frozen=True, slots=True)
class Figures:
    canary: Side
    stable: Side
    proxies: int


def aggregate(
    heartbeats: Iterable[cpb.ProxyHeartbeat], env_id: str, tag: str, canary_release: str, stable_release: str
) -> Figures:
    """The step's figures: every fresh proxy heartbeat's counters of this env, tag and release."""
    sums: dict[str, tuple[int, int, list[int], float]] = {}
    proxies = 0
    for heartbeat in heartbeats:
        proxies += 1
        for traffic in heartbeat.release_traffic:
            if traffic.environment_id != env_id or traffic.step_tag != tag:
                continue
            if traffic.release_id not in (canary_release, stable_release):
                continue
            requests, errors, buckets, weighted_avg = sums.get(traffic.release_id, (0, 0, [], 0.0))
            add_buckets(buckets, traffic.latency_buckets)
            sums[traffic.release_id] = (
                requests + traffic.requests,
                errors + traffic.errors_5xx,
                buckets,
                weighted_avg + traffic.latency_avg_ms * traffic.requests,
            )

    def side(release_id: str) -> Side:
        requests, errors, buckets, weighted_avg = sums.get(release_id, (0, 0, [], 0.0))
        return Side(requests, errors, tuple(buckets), weighted_avg / requests if requests else 0.0)

    return Figures(side(canary_release), side(stable_release), proxies)


@dataclass(frozen=True, slots=True)
class Verdict:
    breach: str
    """"" = no bound broken; else what broke, with the figures (the abort's reason)."""
    enough: bool
    """The new release had at least ``min_requests`` requests in this step."""
    summary: str
    """The figures against the bounds, one line."""


def judge(spec: pb.CanarySpec, figures: Figures) -> Verdict:
    """Judge one step: nothing is judged before ``min_requests`` requests reached the new release; then the
    5xx ratio and the latency relative to the stable release are compared with their bounds."""
    canary, stable = figures.canary, figures.stable
    enough = canary.requests >= spec.min_requests
    ratio = latency_ratio(figures)
    kind = canary.latency_kind
    summary = (
        f"requests {canary.requests}/{spec.min_requests}, 5xx {canary.error_ratio:.2%} "
        f"(max {spec.max_error_ratio:.2%}), {kind} {canary.latency_ms:g} ms vs stable {stable.latency_ms:g} ms "
        f"(x{ratio:.2f}, max x{spec.max_latency_ratio:g})"
    )
    breach = ""
    if enough:
        if canary.error_ratio > spec.max_error_ratio:
            breach = f"5xx ratio {canary.error_ratio:.2%} above {spec.max_error_ratio:.2%}"
        elif ratio > spec.max_latency_ratio:
            breach = f"{kind} latency x{ratio:.2f} the stable release's, above x{spec.max_latency_ratio:g}"
    return Verdict(breach, enough, summary)


def latency_ratio(figures: Figures) -> float:
    """New over stable latency; 0 (not judged) when either has no data or the new release's latency is
    under :data:`LATENCY_FLOOR_MS`."""
    canary_ms, stable_ms = figures.canary.latency_ms, figures.stable.latency_ms
    if canary_ms < LATENCY_FLOOR_MS or stable_ms <= 0 or figures.stable.requests == 0:
        return 0.0
    return canary_ms / stable_ms


def canary_spec(release: pb.Release) -> pb.CanarySpec | None:
    """The release's canary settings (None: red/green), with defaults for what is unset."""
    if not release.service.HasField("canary"):
        return None
    spec = pb.CanarySpec()
    spec.CopyFrom(release.service.canary)
    if not spec.steps:
        spec.steps.extend(CANARY_DEFAULT_STEPS)
    if not spec.min_requests:
        spec.min_requests = CANARY_DEFAULT_MIN_REQUESTS
    if not spec.max_latency_ratio:
        spec.max_latency_ratio = CANARY_DEFAULT_MAX_LATENCY_RATIO
    return spec


def describe(d: pb.Deployment, release: pb.Release | None, heartbeats: Iterable[cpb.ProxyHeartbeat]) -> str:
    """A canary deployment's step, weights and live figures against the bounds, one line (``zattera deploy
    watch``, the console); "" when ``d`` is not in its canary phase."""
    if d.phase != pb.DEPLOYMENT_PHASE_CANARY:
        return ""
    spec = canary_spec(release) if release is not None else None
    if spec is None:
        return ""
    weight = d.canary.weight
    figures = aggregate(
        heartbeats, d.environment_id, step_tag(d.meta.id, d.canary.step), d.release_id, d.previous_release_id
    )
    verdict = judge(spec, figures)
    asked = f"; {d.canary.requested} requested by {d.canary.requested_by}" if d.canary.requested else ""
    return (
        f"canary step {d.canary.step + 1}/{len(spec.steps)}: new {weight}% / stable {100 - weight}%; "
        f"{verdict.summary}; {figures.proxies} proxies{asked}"
    )
