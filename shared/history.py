"""Metrics history (issue 40): the figures of the heartbeats, kept over time by the cluster itself.

Two JetStream streams, one per resolution (docs/observability.md, "History"):

* ``ZATTERA_METRICS``: a :class:`MetricPoint` every 10 s per env, node and proxy, subjects
  ``zattera.metrics.10s.<kind>.<id>``, kept 24 h (the stream's ``max_age``);
* ``ZATTERA_METRICS_5M``: the same downsampled to 5 min, ``zattera.metrics.5m.<kind>.<id>``, kept 30 days,
  and the env's marks (deploys, scaling) on ``zattera.metrics.mark.env.<id>`` (JSON).

Both are written by one leader loop (``services/autoscale/history.py``). This module is the pure part —
the point a sample makes (:class:`Recorder`), downsampling (:func:`downsample`), dense series for charts
(:func:`dense`); the reads are :mod:`shared.history_read`. An idle
env (nothing running, no traffic) writes no point once a zero point is written: a missing env point
reads as zero.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.js.api import StorageType, StreamConfig
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.errors import ZatteraError
from shared.events import SCALE_KINDS

RAW_SPAN = 10
"""Seconds of one raw point."""
DOWN_SPAN = 300
"""Seconds of one downsampled point."""
DAY = 86_400.0
RAW_MAX_AGE = DAY
DOWN_MAX_AGE = 30 * DAY
METRICS_STREAM = "ZATTERA_METRICS"
METRICS_5M_STREAM = "ZATTERA_METRICS_5M"
PREFIX = "zattera.metrics."
RAW = "10s"
DOWN = "5m"
MARK = "mark"
ENV = "env"
NODE = "node"
PROXY = "proxy"
KINDS = (ENV, NODE, PROXY)
MARK_KINDS = (
    "deploy.succeeded",
    "deploy.promoted",
    "deploy.rolled_back",
    "deploy.failed",
    "deploy.canceled",
    *SCALE_KINDS,
)
"""Event kinds copied as marks on an env's time axis (deploys and scaling)."""
DUPLICATE_WINDOW = 600.0


class HistoryError(ZatteraError, ValueError):
    """A bad history request (names the field)."""


def subject(resolution: str, kind: str, ident: str) -> str:
    return f"{PREFIX}{resolution}.{kind}.{ident}"


def mark_subject(env_id: str) -> str:
    return f"{PREFIX}{MARK}.{ENV}.{env_id}"


def stream_configs(replicas: int) -> list[StreamConfig]:
    """The two streams: raw points kept a day, downsampled points and marks kept 30 days. One stream per
    retention: ``max_age`` drops whole blocks at no cost per message (a per-message TTL header would add
    ~20 bytes to points of ~30)."""
    common: dict[str, Any] = {
        "num_replicas": replicas,
        "allow_direct": True,
        "storage": StorageType.FILE,
        "duplicate_window": DUPLICATE_WINDOW,
    }
    return [
        StreamConfig(name=METRICS_STREAM, subjects=[f"{PREFIX}{RAW}.>"], max_age=RAW_MAX_AGE, **common),
        StreamConfig(
            name=METRICS_5M_STREAM, subjects=[f"{PREFIX}{DOWN}.>", f"{PREFIX}{MARK}.>"], max_age=DOWN_MAX_AGE, **common
        ),
    ]


async def ensure_streams(js: Any, replicas: int) -> None:
    """Create the metrics streams unless they exist (the recorder does at the start of each term)."""
    for config in stream_configs(replicas):
        try:
            await js.stream_info(config.name)
        except nats.js.errors.NotFoundError:
            await js.add_stream(config)


# ------------------------------------------------------------------ sampling (pure)


@dataclass(slots=True)
class _Previous:
    at: float
    totals: tuple[int, int, int, int]


def _totals(sample: cpb.ProxySample) -> tuple[int, int, int, int]:
    return (
        sample.requests_total,
        sample.responses_2xx_total,
        sample.responses_4xx_total,
        sample.responses_5xx_total,
    )


def _hb_time(hb: cpb.Heartbeat | cpb.ProxyHeartbeat) -> float:
    return float(hb.time.seconds + hb.time.nanos / 1e9)


@dataclass(slots=True)
class EnvFacts:
    """What the state says of an env at a pass: replicas desired and running."""

    desired: int = 0
    running: int = 0


def is_idle(point: cpb.MetricPoint) -> bool:
    """Nothing to chart: no traffic, nothing running or wanted, no usage."""
    rest = cpb.MetricPoint()
    rest.CopyFrom(point)
    rest.ClearField("time")
    rest.ClearField("span")
    return rest.ByteSize() == 0


@dataclass
class Recorder:
    """Turns the heartbeats seen at each pass into points. Counters are differenced per (reporter, env)
    between passes (exact counts and rates whatever the heartbeat interval; a counter that went down — a
    proxy restart — counts from zero)."""

    previous: dict[tuple[str, str], _Previous] = field(default_factory=dict)
    written_nonidle: set[str] = field(default_factory=set)
    """Subjects whose last written point was not idle (the next idle one is still written, once)."""

    def points(
        self,
        at: float,
        node_heartbeats: Mapping[str, cpb.Heartbeat],
        proxy_heartbeats: Iterable[cpb.ProxyHeartbeat],
        envs: Mapping[str, EnvFacts],
        env_of_instance: Mapping[str, str],
    ) -> dict[str, cpb.MetricPoint]:
        """subject → point for the 10-s slot that ended at ``at``'s slot boundary (its ``time`` is that
        slot's start: ``at`` 12:00:10.3 → 12:00:00); only what is to be written."""
        slot = int(at // RAW_SPAN * RAW_SPAN) - RAW_SPAN
        env_points: dict[str, cpb.MetricPoint] = {
            env_id: cpb.MetricPoint(time=slot, span=RAW_SPAN, desired=facts.desired, running=facts.running)
            for env_id, facts in envs.items()
        }
        weights: dict[str, float] = {}
        proxy_points: dict[str, cpb.MetricPoint] = {}
        seen: set[tuple[str, str]] = set()
        reporters: list[tuple[str, cpb.Heartbeat | cpb.ProxyHeartbeat, Mapping[str, cpb.ProxySample]]] = [
            (f"node.{node_id}", hb, hb.proxy) for node_id, hb in node_heartbeats.items()
        ]
        for phb in proxy_heartbeats:
            reporters.append((f"proxy.{phb.proxy_id}", phb, phb.envs))
            proxy_points[phb.proxy_id] = cpb.MetricPoint(time=slot, span=RAW_SPAN, connections=phb.connections)
        for reporter, hb, samples in reporters:
            hb_at = _hb_time(hb)
            for env_id, sample in samples.items():
                key = (reporter, env_id)
                seen.add(key)
                totals = _totals(sample)
                before = self.previous.get(key)
                self.previous[key] = _Previous(hb_at, totals)
                point = env_points.get(env_id)
                if point is None:
                    continue  # an env the state no longer has
                if before is not None and hb_at > before.at:
                    went_down = any(now < then for now, then in zip(totals, before.totals, strict=True))
                    delta = totals if went_down else tuple(n - t for n, t in zip(totals, before.totals, strict=True))
                    rps = delta[0] / (hb_at - before.at)
                    point.responses_2xx += delta[1]
                    point.responses_4xx += delta[2]
                    point.responses_5xx += delta[3]
                elif before is None or not any(totals):
                    rps = sample.rps  # a first sample (or a proxy without counters): its own rate
                else:
                    rps = 0.0  # no newer heartbeat since the previous pass: counted then
                point.rps += rps
                point.inflight += sample.inflight + sample.held
                weight = max(rps, 1e-9)
                weights[env_id] = weights.get(env_id, 0.0) + weight
                point.latency_p50_ms += sample.latency_p50_ms * weight
                point.latency_p95_ms = max(point.latency_p95_ms, sample.latency_p95_ms or sample.latency_p99_ms)
                point.latency_p99_ms = max(point.latency_p99_ms, sample.latency_p99_ms)
                if reporter.startswith("proxy."):
                    proxy_points[reporter[6:]].rps += rps
        for key in [k for k in self.previous if k not in seen]:
            del self.previous[key]
        for env_id, weight in weights.items():
            env_points[env_id].latency_p50_ms /= weight
        node_points: dict[str, cpb.MetricPoint] = {}
        for node_id, hb in node_heartbeats.items():
            node_points[node_id] = cpb.MetricPoint(
                time=slot,
                span=RAW_SPAN,
                cpu_percent=hb.cpu_percent,
                memory_bytes=hb.memory_used_bytes,
                memory_total_bytes=hb.memory_total_bytes,
                disk_used_bytes=hb.disk_used_bytes,
                disk_total_bytes=hb.disk_total_bytes,
                instances=len(hb.instances),
            )
            for aid, usage in hb.instances.items():
                env_point = env_points.get(env_of_instance.get(aid, ""))
                if env_point is not None:
                    env_point.cpu_percent += usage.cpu_percent
                    env_point.memory_bytes += usage.memory_bytes
        out: dict[str, cpb.MetricPoint] = {}
        for env_id, point in env_points.items():
            name = subject(RAW, ENV, env_id)
            if is_idle(point):
                if name not in self.written_nonidle:
                    continue
                self.written_nonidle.discard(name)
            else:
                self.written_nonidle.add(name)
            out[name] = point
        for node_id, point in node_points.items():
            out[subject(RAW, NODE, node_id)] = point
        for proxy_id, point in proxy_points.items():
            out[subject(RAW, PROXY, proxy_id)] = point
        return out


# ------------------------------------------------------------------ downsampling (pure)


def bucket_of(t: float, span: int = DOWN_SPAN) -> int:
    return int(t // span * span)


def downsample(
    points: Sequence[cpb.MetricPoint], start: int, span: int = DOWN_SPAN, *, slots: float | None = None
) -> cpb.MetricPoint:
    """One point for ``[start, start+span)`` from the raw points within it. Missing raw points of an env
    are idle (zero): rates, in-flight and CPU are averaged over the whole span; counts add up; p50 is
    the request-weighted mean, p95/p99 the worst; replicas, memory, disk and instances the largest."""
    out = cpb.MetricPoint(time=start, span=span, samples=len(points))
    if not points:
        return out
    out.replicas.extend(downsample_replicas(points))
    slots = max(slots if slots is not None else span / RAW_SPAN, 1.0)
    weight = 0.0
    for p in points:
        out.rps += p.rps / slots
        out.inflight += p.inflight / slots
        out.cpu_percent += p.cpu_percent / slots
        out.responses_2xx += p.responses_2xx
        out.responses_4xx += p.responses_4xx
        out.responses_5xx += p.responses_5xx
        w = max(p.rps, 1e-9)
        weight += w
        out.latency_p50_ms += p.latency_p50_ms * w
        out.latency_p95_ms = max(out.latency_p95_ms, p.latency_p95_ms)
        out.latency_p99_ms = max(out.latency_p99_ms, p.latency_p99_ms)
        out.desired = max(out.desired, p.desired)
        out.running = max(out.running, p.running)
        out.memory_bytes = max(out.memory_bytes, p.memory_bytes)
        out.memory_total_bytes = max(out.memory_total_bytes, p.memory_total_bytes)
        out.disk_used_bytes = max(out.disk_used_bytes, p.disk_used_bytes)
        out.disk_total_bytes = max(out.disk_total_bytes, p.disk_total_bytes)
        out.instances = max(out.instances, p.instances)
        out.connections = max(out.connections, p.connections)
    out.latency_p50_ms /= weight
    if points[0].memory_total_bytes or points[0].disk_total_bytes:
        # a node writes every point: average over the points it wrote, not over the span
        out.cpu_percent = sum(p.cpu_percent for p in points) / len(points)
    return out


@dataclass
class Downsampler:
    """Keeps the raw points of the current 5-min bucket per subject; :meth:`add` returns the downsampled
    points of buckets that ended (subject → point, the ``5m`` subjects)."""

    span: int = DOWN_SPAN
    bucket: int | None = None
    pending: dict[str, list[cpb.MetricPoint]] = field(default_factory=dict)

    def add(self, raw: Mapping[str, cpb.MetricPoint], at: float) -> dict[str, cpb.MetricPoint]:
        current = bucket_of(at, self.span)
        done: dict[str, cpb.MetricPoint] = {}
        if self.bucket is not None and current > self.bucket:
            done = self.flush()
        self.bucket = current
        for name, point in raw.items():
            if bucket_of(point.time, self.span) == current:
                self.pending.setdefault(name, []).append(point)
        return done

    def flush(self) -> dict[str, cpb.MetricPoint]:
        done: dict[str, cpb.MetricPoint] = {}
        if self.bucket is None:
            return done
        for name, points in self.pending.items():
            down_name = name.replace(f"{PREFIX}{RAW}.", f"{PREFIX}{DOWN}.", 1)
            done[down_name] = downsample(points, self.bucket, self.span)
        self.pending = {}
        return done


# ------------------------------------------------------------------ series for charts (pure)

FIGURES: dict[str, tuple[str, ...]] = {
    ENV: (
        "rps",
        "responses_2xx",
        "responses_4xx",
        "responses_5xx",
        "latency_p50_ms",
        "latency_p95_ms",
        "latency_p99_ms",
        "inflight",
        "desired",
        "running",
        "cpu_percent",
        "memory_bytes",
    ),
    NODE: (
        "cpu_percent",
        "memory_bytes",
        "memory_total_bytes",
        "disk_used_bytes",
        "disk_total_bytes",
        "instances",
    ),
    PROXY: ("rps", "connections"),
}


def dense(
    points: Sequence[cpb.MetricPoint], start: int, end: int, span: int, *, gap: float | None = 0.0
) -> list[tuple[int, cpb.MetricPoint | None]]:
    """One slot per ``span`` from ``start`` to ``end`` (exclusive), each with the point of that slot (the
    last one written when several; None when missing and ``gap`` is None)."""
    by_slot: dict[int, cpb.MetricPoint] = {}
    for point in points:
        by_slot[bucket_of(point.time, span)] = point
    first = bucket_of(start, span)
    out: list[tuple[int, cpb.MetricPoint | None]] = []
    for slot in range(first, end, span):
        found = by_slot.get(slot)
        if found is None and gap is not None:
            found = cpb.MetricPoint(time=slot, span=span)
        out.append((slot, found))
    return out


def regroup(points: Sequence[cpb.MetricPoint], span: int) -> list[cpb.MetricPoint]:
    """Points merged into coarser ``span`` slots (a 7-day chart of 5-min points drawn per 30 min)."""
    groups: dict[int, list[cpb.MetricPoint]] = {}
    for point in points:
        groups.setdefault(bucket_of(point.time, span), []).append(point)
    merged = []
    for start, group in sorted(groups.items()):
        down = downsample(_as_raw(group, span), start, span)
        down.samples = sum(p.samples or 1 for p in group)
        merged.append(down)
    return merged


def _as_raw(points: Sequence[cpb.MetricPoint], span: int) -> list[cpb.MetricPoint]:
    """Scale coarse points so :func:`downsample` (which assumes 10-s points) averages them right."""
    out = []
    for p in points:
        q = cpb.MetricPoint()
        q.CopyFrom(p)
        factor = (p.span or RAW_SPAN) / RAW_SPAN
        q.rps = p.rps * factor
        q.inflight = p.inflight * factor
        q.cpu_percent = p.cpu_percent * factor if not (p.memory_total_bytes or p.disk_total_bytes) else p.cpu_percent
        out.append(q)
    return out


def figure(point: cpb.MetricPoint | None, name: str) -> float | None:
    if point is None:
        return None
    return float(getattr(point, name))


def rate(point: cpb.MetricPoint, name: str) -> float:
    """A count field as a per-second rate over the point's span."""
    return float(getattr(point, name)) / float(point.span or RAW_SPAN)


@dataclass(frozen=True, slots=True)
class Mark:
    time: float
    kind: str
    text: str


def mark_of(event_time: float, kind: str, message: str) -> bytes:
    return json.dumps({"time": round(event_time, 3), "kind": kind, "text": message[:200]}).encode()


# ------------------------------------------------------------------ per replica (pure; issue 40, "per replica")

REPLICA_ID = 8
"""Characters of an assignment id a replica's entry keeps (its random tail: unique within an env)."""


def replica_id(assignment_id: str) -> str:
    """An assignment id's short form: its last :data:`REPLICA_ID` characters (whole when 10 or fewer)."""
    return assignment_id if len(assignment_id) <= REPLICA_ID + 2 else assignment_id[-REPLICA_ID:]


@dataclass
class ReplicaRecorder:
    """Adds each replica's CPU and memory (the node heartbeats' per-instance samples) to the env points of a
    pass. Labels (node, release version) are written in a replica's first point of the term and in the first
    point of each 5-min bucket, not in every point: a reader of any window finds them within 5 minutes."""

    labelled: set[str] = field(default_factory=set)
    """Assignment ids whose labels were written this term (and that still report)."""

    def add(
        self,
        points: Mapping[str, cpb.MetricPoint],
        node_heartbeats: Mapping[str, cpb.Heartbeat],
        env_of_instance: Mapping[str, str],
        versions: Mapping[str, int],
    ) -> None:
        """``points``: a pass's points (:meth:`Recorder.points`), extended in place; ``versions``: assignment id →
        its release version. Entries are in a stable order (node, then assignment id)."""
        seen: set[str] = set()
        for node_id in sorted(node_heartbeats):
            hb = node_heartbeats[node_id]
            for aid in sorted(hb.instances):
                point = points.get(subject(RAW, ENV, env_of_instance.get(aid, "")))
                if point is None:
                    continue  # not an env's instance, or its env writes no point this pass
                usage = hb.instances[aid]
                entry = point.replicas.add(
                    id=replica_id(aid), cpu_percent=usage.cpu_percent, memory_bytes=usage.memory_bytes
                )
                if aid not in self.labelled or point.time % DOWN_SPAN == 0:
                    entry.node = node_id
                    entry.version = versions.get(aid, 0)
                seen.add(aid)
        self.labelled = seen


def downsample_replicas(points: Sequence[cpb.MetricPoint]) -> list[cpb.ReplicaUsage]:
    """The replicas of ``points`` folded into one entry each (in order of first appearance): CPU the mean over
    the points the replica reported in (weighted by their ``samples`` when already downsampled: a replica that
    ran a minute of the span is not diluted), memory the largest, labels from any point that has them."""
    merged: dict[str, cpb.ReplicaUsage] = {}
    cpu: dict[str, float] = {}
    for point in points:
        for r in point.replicas:
            out = merged.get(r.id)
            if out is None:
                out = merged[r.id] = cpb.ReplicaUsage(id=r.id)
                cpu[r.id] = 0.0
            weight = r.samples or 1
            cpu[r.id] += r.cpu_percent * weight
            out.samples += weight
            out.memory_bytes = max(out.memory_bytes, r.memory_bytes)
            if r.node:
                out.node = r.node
            if r.version:
                out.version = r.version
    for rid, out in merged.items():
        out.cpu_percent = cpu[rid] / out.samples
    return list(merged.values())
