"""Per-env ``ProxySample`` from HAProxy's ``show stat`` backend rows (pure, for the autoscaler).

``scur`` (current streams) is in-flight, ``qcur`` (requests queued for a server under ``maxconn``: a full
env) is held, RPS and the error rate come from the deltas of ``stot`` (one stream per HTTP request) and
``hrsp_5xx`` between two samples (a reload or restart zeroes them: a smaller value starts over). Latency
is the p50/p95/p99 of the env's last logged requests (HAProxy's request log,
:mod:`services.proxy.haproxy_latency`); else — logging off, or nothing logged yet — ``ttime``: HAProxy's
average total time over the backend's last 1024 requests (its stats keep no percentiles: p50, p95 and p99
then all carry the average). ``lastsess`` (seconds since the last request) gives ``last_request_at``.
Several backends of one env (different middleware per domain) are summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.haproxy_config import NO_ROUTE_BACKEND
from services.proxy.stats import ReleaseCounters
from shared.clock import to_timestamp


def _int(row: Mapping[str, str], name: str) -> int:
    value = row.get(name, "")
    return int(value) if value.lstrip("-").isdigit() else 0


STATUS_CLASSES = (1, 2, 3, 4, 5)


@dataclass(frozen=True, slots=True)
class _Counters:
    requests: int
    by_class: tuple[int, ...]
    """hrsp_1xx … hrsp_5xx."""

    @classmethod
    def of(cls, row: Mapping[str, str]) -> _Counters:
        return cls(_int(row, "stot"), tuple(_int(row, f"hrsp_{c}xx") for c in STATUS_CLASSES))

    def since(self, before: _Counters | None) -> _Counters:
        """The increase since ``before``; everything when a counter went down (a reload or restart)."""
        if (
            before is None
            or self.requests < before.requests
            or any(now < then for now, then in zip(self.by_class, before.by_class, strict=True))
        ):
            return self
        return _Counters(
            self.requests - before.requests,
            tuple(now - then for now, then in zip(self.by_class, before.by_class, strict=True)),
        )


@dataclass(frozen=True, slots=True)
class Responses:
    """Responses of one env (``""``: no route) and status class since the previous sample, for the
    request metrics; ``seconds`` is the backend's average total time (HAProxy keeps no histogram)."""

    env_id: str
    status_class: int
    count: int
    seconds: float


class HAProxySampler:
    def __init__(self, now: float) -> None:
        self._previous: dict[tuple[str, str], _Counters] = {}
        self._at = now
        self._totals: dict[str, list[int]] = {}
        """Env id → [requests, 2xx, 4xx, 5xx] since this sampler started (``ProxySample.*_total``): the
        deltas added up, so a reload zeroing HAProxy's own counters does not make them go down."""
        self.responses: list[Responses] = []
        """Filled by :meth:`sample`: what was answered since the previous one (hold backend excluded:
        the Python handler measures its own requests)."""
        self.backend_rates: dict[str, float] = {}
        """Filled by :meth:`sample`: requests/s of each routed backend since the previous one."""

    def sample(
        self,
        rows: Sequence[Mapping[str, str]],
        env_of_backend: Mapping[str, str],
        now: float,
        latencies: Mapping[str, tuple[float, float, float]] | None = None,
    ) -> dict[str, cpb.ProxySample]:
        """``latencies``: env id → (p50, p95, p99) from the request log, used instead of the average."""
        elapsed = max(now - self._at, 1e-9)
        self._at = now
        samples: dict[str, cpb.ProxySample] = {}
        weights: dict[str, int] = {}
        previous, self._previous = self._previous, {}
        self.responses = []
        self.backend_rates = {}
        answered_by_backends = [0] * len(STATUS_CLASSES)
        answered_by_frontend = [0] * len(STATUS_CLASSES)
        for row in rows:
            key = (row.get("pxname", ""), row.get("svname", ""))
            if key[1] not in ("BACKEND", "FRONTEND"):
                continue
            counters = _Counters.of(row)
            self._previous[key] = counters
            delta = counters.since(previous.get(key))
            if key == (NO_ROUTE_BACKEND, "BACKEND"):
                continue  # its 404s stay the frontend's own answers ("no route", below)
            total_by_class = answered_by_frontend if key[1] == "FRONTEND" else answered_by_backends
            for index, count in enumerate(delta.by_class):
                total_by_class[index] += count
            env_id = env_of_backend.get(key[0]) if key[1] == "BACKEND" else None
            if env_id is None:
                continue
            average_ms = float(_int(row, "ttime"))
            self.responses += [
                Responses(env_id, status_class, count, average_ms / 1000)
                for status_class, count in zip(STATUS_CLASSES, delta.by_class, strict=True)
                if count
            ]
            requests, errors = delta.requests, delta.by_class[-1]
            self.backend_rates[key[0]] = requests / elapsed
            totals = self._totals.setdefault(env_id, [0, 0, 0, 0])
            for index, count in enumerate((requests, delta.by_class[1], delta.by_class[3], delta.by_class[4])):
                totals[index] += count
            sample = samples.setdefault(env_id, cpb.ProxySample())
            (
                sample.requests_total,
                sample.responses_2xx_total,
                sample.responses_4xx_total,
                sample.responses_5xx_total,
            ) = totals
            sample.inflight += _int(row, "scur")
            sample.held += _int(row, "qcur")
            sample.rps += requests / elapsed
            total = weights.get(env_id, 0) + requests
            if total:
                sample.error_rate = (sample.error_rate * weights.get(env_id, 0) + errors) / total
            weights[env_id] = total
            sample.latency_p50_ms = max(sample.latency_p50_ms, average_ms)
            sample.latency_p99_ms = max(sample.latency_p99_ms, average_ms)
            sample.latency_p95_ms = max(sample.latency_p95_ms, average_ms)
            idle = _int(row, "lastsess") if row.get("lastsess", "") not in ("", "-1") else -1
            if idle >= 0:
                at = to_timestamp(now - idle)
                if (
                    not sample.HasField("last_request_at")
                    or at.ToNanoseconds() > sample.last_request_at.ToNanoseconds()
                ):
                    sample.last_request_at.CopyFrom(at)
        # Answered by the frontend itself (no route: the 404): what no backend answered.
        for status_class, by_frontend, by_backends in zip(
            STATUS_CLASSES, answered_by_frontend, answered_by_backends, strict=True
        ):
            if by_frontend > by_backends:
                self.responses.append(Responses("", status_class, by_frontend - by_backends, 0.0))
        for env_id, (p50, p95, p99) in (latencies or {}).items():
            logged = samples.get(env_id)
            if logged is not None:
                logged.latency_p50_ms, logged.latency_p95_ms, logged.latency_p99_ms = p50, p95, p99
        return samples


def merge_samples(*sources: Mapping[str, cpb.ProxySample]) -> dict[str, cpb.ProxySample]:
    """One sample per env from several data paths (HAProxy, the Python hold handler): counts add up,
    the error rate is RPS-weighted, latency and the last request time take the larger value."""
    merged: dict[str, cpb.ProxySample] = {}
    for source in sources:
        for env_id, sample in source.items():
            into = merged.get(env_id)
            if into is None:
                merged[env_id] = into = cpb.ProxySample()
                into.CopyFrom(sample)
                continue
            total_rps = into.rps + sample.rps
            if total_rps > 0:
                into.error_rate = (into.error_rate * into.rps + sample.error_rate * sample.rps) / total_rps
            into.rps = total_rps
            into.inflight += sample.inflight
            into.held += sample.held
            into.latency_p50_ms = max(into.latency_p50_ms, sample.latency_p50_ms)
            into.latency_p99_ms = max(into.latency_p99_ms, sample.latency_p99_ms)
            into.latency_p95_ms = max(into.latency_p95_ms, sample.latency_p95_ms)
            into.requests_total += sample.requests_total
            into.responses_2xx_total += sample.responses_2xx_total
            into.responses_4xx_total += sample.responses_4xx_total
            into.responses_5xx_total += sample.responses_5xx_total
            if sample.HasField("last_request_at") and (
                not into.HasField("last_request_at")
                or sample.last_request_at.ToNanoseconds() > into.last_request_at.ToNanoseconds()
            ):
                into.last_request_at.CopyFrom(sample.last_request_at)
    return merged


class ServerTraffic:
    """Per (env, release, step tag) counters of weighted (canary) routes from HAProxy's server rows (issue
    41): requests (``stot``) and 5xx (``hrsp_5xx``) since the first sample that saw the server under that
    tag (a reload or restart zeroes them: the counts start over), the average response time (``rtime``),
    and the release's latency histogram from the request log when it is on (``histograms``)."""

    def __init__(self) -> None:
        self._baseline: dict[tuple[str, str, str], tuple[int, int]] = {}
        self.report: list[cpb.ReleaseTraffic] = []

    def sample(
        self,
        rows: Sequence[Mapping[str, str]],
        servers: Mapping[tuple[str, str], tuple[str, str, str]],
        histograms: ReleaseCounters | None = None,
    ) -> None:
        """``servers``: (backend, server) → (env id, release id, step tag) of the weighted servers;
        ``histograms``: the logged latencies by (env, release, tag)."""
        totals: dict[tuple[str, str, str], cpb.ReleaseTraffic] = {}
        seen: set[tuple[str, str, str]] = set()
        for row in rows:
            key = (row.get("pxname", ""), row.get("svname", ""))
            owner = servers.get(key)
            if owner is None:
                continue
            env_id, release_id, tag = owner
            requests, errors = _int(row, "stot"), _int(row, "hrsp_5xx")
            base_key = (key[0], key[1], tag)
            seen.add(base_key)
            base = self._baseline.get(base_key)
            if base is None or requests < base[0] or errors < base[1]:
                base = (requests, errors) if base is None else (0, 0)
                self._baseline[base_key] = base
            traffic = totals.get(owner)
            if traffic is None:
                traffic = totals[owner] = cpb.ReleaseTraffic(environment_id=env_id, release_id=release_id, step_tag=tag)
            delta = requests - base[0]
            if delta > 0:
                average = _int(row, "rtime")
                total = traffic.requests + delta
                traffic.latency_avg_ms = (traffic.latency_avg_ms * traffic.requests + average * delta) / total
            traffic.requests += delta
            traffic.errors_5xx += errors - base[1]
        self._baseline = {k: v for k, v in self._baseline.items() if k in seen}
        if histograms is not None:
            for (env_id, release_id, tag), traffic in totals.items():
                logged = histograms.buckets(env_id, release_id, tag)
                if logged is not None:
                    traffic.latency_buckets.extend(logged)
        self.report = list(totals.values())
