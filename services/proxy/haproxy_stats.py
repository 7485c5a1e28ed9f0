"""Per-env ``ProxySample`` from HAProxy's ``show stat`` backend rows (pure, for the autoscaler).

``scur`` (current streams) is in-flight, ``qcur`` (requests queued for a server under ``maxconn``: a full
env) is held, RPS and the error rate come from the deltas of ``stot`` (one stream per HTTP request) and
``hrsp_5xx`` between two samples (a reload or restart zeroes them: a smaller value starts over), latency is
``ttime``: HAProxy's average total time over the backend's last 1024 requests (HAProxy keeps no
percentiles; p50 and p99 both carry the average). ``lastsess`` (seconds since the last request) gives
``last_request_at``. Several backends of one env (different middleware per domain) are summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp
from zattera.cluster.v1 import cluster_pb2 as cpb


def _int(row: Mapping[str, str], name: str) -> int:
    value = row.get(name, "")
    return int(value) if value.lstrip("-").isdigit() else 0


@dataclass(slots=True)
class _Counters:
    requests: int
    errors: int


class HAProxySampler:
    def __init__(self, now: float) -> None:
        self._previous: dict[str, _Counters] = {}
        self._at = now

    def sample(
        self, rows: Sequence[Mapping[str, str]], env_of_backend: Mapping[str, str], now: float
    ) -> dict[str, cpb.ProxySample]:
        elapsed = max(now - self._at, 1e-9)
        self._at = now
        samples: dict[str, cpb.ProxySample] = {}
        weights: dict[str, int] = {}
        previous, self._previous = self._previous, {}
        for row in rows:
            if row.get("svname") != "BACKEND":
                continue
            backend = row["pxname"]
            env_id = env_of_backend.get(backend)
            if env_id is None:
                continue
            counters = _Counters(_int(row, "stot"), _int(row, "hrsp_5xx"))
            self._previous[backend] = counters
            before = previous.get(backend, _Counters(0, 0))
            if counters.requests < before.requests:  # restarted or reloaded: counters start over
                before = _Counters(0, 0)
            requests, errors = counters.requests - before.requests, counters.errors - before.errors
            sample = samples.setdefault(env_id, cpb.ProxySample())
            sample.inflight += _int(row, "scur")
            sample.held += _int(row, "qcur")
            sample.rps += requests / elapsed
            total = weights.get(env_id, 0) + requests
            if total:
                sample.error_rate = (sample.error_rate * weights.get(env_id, 0) + errors) / total
            weights[env_id] = total
            average = float(_int(row, "ttime"))
            sample.latency_p50_ms = max(sample.latency_p50_ms, average)
            sample.latency_p99_ms = max(sample.latency_p99_ms, average)
            idle = _int(row, "lastsess") if row.get("lastsess", "") not in ("", "-1") else -1
            if idle >= 0:
                at = Timestamp()
                at.FromNanoseconds(int((now - idle) * 1e9))
                if (
                    not sample.HasField("last_request_at")
                    or at.ToNanoseconds() > sample.last_request_at.ToNanoseconds()
                ):
                    sample.last_request_at.CopyFrom(at)
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
            if sample.HasField("last_request_at") and (
                not into.HasField("last_request_at")
                or sample.last_request_at.ToNanoseconds() > into.last_request_at.ToNanoseconds()
            ):
                into.last_request_at.CopyFrom(sample.last_request_at)
    return merged
