"""Per-env traffic counters of this proxy and the ``ProxySample`` they produce (a ``ProxyHeartbeat`` every
2 s: what the scaling loops read).

A request counts once an endpoint is chosen: begin → in-flight + 1, last_request_at = now; end →
in-flight − 1 and (latency, error) appended to a ring of the last :data:`LATENCY_WINDOW` completions.
Held requests are reported separately in ``held`` (the scaling loops add them to in-flight demand).

* ``error_rate`` is over the same last 512 completions as the latency percentiles (not cumulative since
  the proxy started, so an old burst of errors fades);
* an env drops out of the report once it is gone from the route snapshot and has nothing in flight
  or held.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.canary import LATENCY_BOUNDS_MS, bucket_of
from shared.clock import stamp, to_timestamp
from shared.version import VERSION

LATENCY_WINDOW = 512
SERVER_ERROR = 500


@dataclass(slots=True)
class EnvStats:
    inflight: int = 0
    started: int = 0
    """Requests begun since the previous sample (the RPS window)."""
    last_request_at: float = 0.0
    completions: deque[tuple[int, bool]] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    """(latency in whole ms, status ≥ 500) of the most recent completions."""
    requests_total: int = 0
    """Requests begun since the proxy started, and responses by class (``ProxySample.*_total``)."""
    responses_2xx_total: int = 0
    responses_4xx_total: int = 0
    responses_5xx_total: int = 0


def percentiles(latencies_ms: list[int]) -> tuple[float, float]:
    """(p50, p99) as nearest ranks: sorted[floor(n·0.5)], sorted[min(floor(n·0.99), n−1)]; 0 if empty."""
    p50, _, p99 = percentiles3(latencies_ms)
    return p50, p99


def percentiles3(latencies_ms: list[int]) -> tuple[float, float, float]:
    """(p50, p95, p99) as nearest ranks (as :func:`percentiles`); 0 if empty."""
    if not latencies_ms:
        return 0.0, 0.0, 0.0
    ordered = sorted(latencies_ms)
    n = len(ordered)
    return float(ordered[n // 2]), float(ordered[min(int(n * 0.95), n - 1)]), float(ordered[min(int(n * 0.99), n - 1)])


class ProxyStats:
    def __init__(self, *, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self._envs: dict[str, EnvStats] = {}
        self._window_start = now()
        self.releases = ReleaseCounters()
        """Per release and step tag of weighted (canary) routes (issue 41)."""

    def env(self, env_id: str) -> EnvStats:
        stats = self._envs.get(env_id)
        if stats is None:
            stats = self._envs[env_id] = EnvStats()
        return stats

    def inflight(self, env_id: str) -> int:
        stats = self._envs.get(env_id)
        return stats.inflight if stats is not None else 0

    def begin(self, env_id: str) -> None:
        stats = self.env(env_id)
        stats.inflight += 1
        stats.started += 1
        stats.requests_total += 1
        stats.last_request_at = self._now()

    def end(self, env_id: str, status: int, latency_seconds: float, endpoint: cpb.Endpoint | None = None) -> None:
        stats = self.env(env_id)
        stats.inflight -= 1
        stats.completions.append((int(latency_seconds * 1000), status >= SERVER_ERROR))
        if status >= SERVER_ERROR:
            stats.responses_5xx_total += 1
        elif status >= 400:
            stats.responses_4xx_total += 1
        elif 200 <= status < 300:
            stats.responses_2xx_total += 1
        if endpoint is not None and endpoint.step_tag:
            self.releases.count(env_id, endpoint, status, latency_seconds * 1000)

    def sample(self, held: Mapping[str, int], routed_envs: Collection[str]) -> dict[str, cpb.ProxySample]:
        """Every reported env's sample; starts a new RPS window. Envs that left the snapshot and are idle
        are forgotten after this."""
        now = self._now()
        elapsed = max(now - self._window_start, 1e-9)
        self._window_start = now
        for env_id in held:
            self.env(env_id)
        samples: dict[str, cpb.ProxySample] = {}
        for env_id, stats in list(self._envs.items()):
            completions = list(stats.completions)
            p50, p95, p99 = percentiles3([latency for latency, _ in completions])
            errors = sum(1 for _, failed in completions if failed)
            sample = cpb.ProxySample(
                inflight=max(stats.inflight, 0),
                held=held.get(env_id, 0),
                rps=stats.started / elapsed,
                error_rate=errors / len(completions) if completions else 0.0,
                latency_p50_ms=p50,
                latency_p99_ms=p99,
                latency_p95_ms=p95,
                requests_total=stats.requests_total,
                responses_2xx_total=stats.responses_2xx_total,
                responses_4xx_total=stats.responses_4xx_total,
                responses_5xx_total=stats.responses_5xx_total,
            )
            if stats.last_request_at:
                stamp(sample.last_request_at, stats.last_request_at)
            samples[env_id] = sample
            stats.started = 0
            if env_id not in routed_envs and stats.inflight <= 0 and not held.get(env_id):
                del self._envs[env_id]
        return samples

    def heartbeat(
        self, proxy_id: str, node_id: str, held: Mapping[str, int], routed_envs: Collection[str]
    ) -> cpb.ProxyHeartbeat:
        envs = self.sample(held, routed_envs)
        return cpb.ProxyHeartbeat(
            time=to_timestamp(self._now()),
            proxy_id=proxy_id,
            node_id=node_id,
            envs=envs,
            version=VERSION,
            connections=sum(max(s.inflight, 0) for s in self._envs.values()),
            release_traffic=self.releases.report(),
        )


class _Counts:
    __slots__ = ("buckets", "errors", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.buckets = [0] * (len(LATENCY_BOUNDS_MS) + 1)


class ReleaseCounters:
    """Requests, 5xx and a latency histogram per (env, release, step tag) of weighted routes, cumulative
    since the tag first counted here; a tag is forgotten once :data:`KEEP_TAGS` newer ones counted. Plain
    integers per request (a protobuf field update costs ~4x more), messages built by :meth:`report`."""

    KEEP_TAGS = 8

    def __init__(self) -> None:
        self._counters: dict[tuple[str, str, str], _Counts] = {}
        self._tags: list[str] = []

    def count(self, env_id: str, endpoint: cpb.Endpoint, status: int, latency_ms: float) -> None:
        self.count_release(env_id, endpoint.release_id, endpoint.step_tag, status, latency_ms)

    def count_release(self, env_id: str, release_id: str, step_tag: str, status: int, latency_ms: float) -> None:
        """One answered request of ``release_id`` under ``step_tag`` (the HAProxy engine: from its request
        log, :mod:`services.proxy.haproxy_latency`)."""
        key = (env_id, release_id, step_tag)
        counts = self._counters.get(key)
        if counts is None:
            counts = self._counters[key] = _Counts()
            if step_tag not in self._tags:
                self._tags.append(step_tag)
                if len(self._tags) > self.KEEP_TAGS:
                    gone = self._tags.pop(0)
                    self._counters = {k: v for k, v in self._counters.items() if k[2] != gone}
        counts.requests += 1
        if status >= SERVER_ERROR:
            counts.errors += 1
        counts.buckets[bucket_of(latency_ms)] += 1

    def buckets(self, env_id: str, release_id: str, step_tag: str) -> list[int] | None:
        """The latency histogram of one release under one tag (None: nothing counted)."""
        counts = self._counters.get((env_id, release_id, step_tag))
        return counts.buckets if counts is not None else None

    def report(self) -> list[cpb.ReleaseTraffic]:
        return [
            cpb.ReleaseTraffic(
                environment_id=env_id,
                release_id=release_id,
                step_tag=tag,
                requests=counts.requests,
                errors_5xx=counts.errors,
                latency_buckets=counts.buckets,
            )
            for (env_id, release_id, tag), counts in self._counters.items()
        ]
