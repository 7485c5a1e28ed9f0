"""Reading the metrics history (docs/observability.md, "History"): the points and marks a window holds, by
batched direct gets (no consumer, any replica answers), and the :class:`History` of one env, node or proxy that
the console's charts and ``zattera metrics`` show. The writing side and the pure series are
:mod:`shared.history`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import ClusterUnavailable
from shared.directget import TooManySubjects, direct_batch
from shared.history import (
    DOWN,
    DOWN_MAX_AGE,
    DOWN_SPAN,
    ENV,
    FIGURES,
    KINDS,
    METRICS_5M_STREAM,
    METRICS_STREAM,
    RAW,
    RAW_SPAN,
    REPLICA_ID,
    HistoryError,
    Mark,
    bucket_of,
    dense,
    downsample,
    mark_subject,
    rate,
    regroup,
    subject,
)

PAGE = 1000


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def read_messages(
    nc: NATS, stream: str, subject_filter: str, since: float, *, timeout: float = 3.0, limit: int = 100_000
) -> list[Msg]:
    """Every message of ``subject_filter`` stored at or after ``since`` (epoch seconds), read by batched
    direct gets (no consumer; any replica answers), pages of :data:`PAGE`."""
    found: list[Msg] = []
    request: dict[str, Any] = {"next_by_subj": subject_filter, "batch": PAGE, "start_time": _rfc3339(since)}
    while len(found) < limit:
        page = await _direct_batch(nc, stream, request, timeout)
        found.extend(page)
        if len(page) < PAGE:
            break
        last_seq = int((page[-1].headers or {}).get("Nats-Sequence", "0"))
        request = {"next_by_subj": subject_filter, "batch": PAGE, "seq": last_seq + 1}
    return found[:limit]


async def _direct_batch(nc: NATS, stream: str, request: dict[str, Any], timeout: float) -> list[Msg]:
    try:
        return await direct_batch(nc, stream, request, timeout)
    except (ClusterUnavailable, TooManySubjects) as exc:
        raise HistoryError(f"reading {stream}: {exc}") from None


async def read_points(nc: NATS, resolution: str, kind: str, ident: str, since: float) -> list[cpb.MetricPoint]:
    stream = METRICS_STREAM if resolution == RAW else METRICS_5M_STREAM
    try:
        msgs = await read_messages(nc, stream, subject(resolution, kind, ident), since)
    except nats.errors.NoRespondersError:
        return []  # no such stream yet: nothing recorded
    points = []
    for msg in msgs:
        with contextlib.suppress(Exception):
            points.append(cpb.MetricPoint.FromString(msg.data))
    return [p for p in points if p.time >= bucket_of(since, p.span or RAW_SPAN)]


async def read_marks(nc: NATS, env_id: str, since: float) -> list[Mark]:
    try:
        msgs = await read_messages(nc, METRICS_5M_STREAM, mark_subject(env_id), since, limit=2000)
    except nats.errors.NoRespondersError:
        return []
    marks = []
    for msg in msgs:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            body = json.loads(msg.data)
            marks.append(Mark(float(body["time"]), str(body["kind"]), str(body.get("text", ""))))
    return [m for m in marks if m.time >= since]


WINDOWS = {"1h": 3600, "6h": 6 * 3600, "24h": 86_400, "7d": 7 * 86_400, "30d": 30 * 86_400}


def parse_since(text: str) -> int:
    """``90s``, ``15m``, ``1h``, ``24h``, ``7d`` → seconds (at most 30 days); :class:`HistoryError` naming
    ``since`` otherwise."""
    text = text.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
    if len(text) < 2 or text[-1] not in units or not text[:-1].isdigit():
        raise HistoryError(f"--since {text!r}: expected a number and a unit s, m, h or d (e.g. 1h, 7d)")
    seconds = int(text[:-1]) * units[text[-1]]
    if not 0 < seconds <= DOWN_MAX_AGE:
        raise HistoryError(f"--since {text!r}: must be more than 0 and at most 30d (the history kept)")
    return seconds


@dataclass(frozen=True)
class History:
    """A series ready to draw or print: ``slots`` (start times) with the point of each (None: unknown),
    the span of a slot, and the env's marks."""

    kind: str
    ident: str
    start: int
    end: int
    span: int
    slots: list[tuple[int, cpb.MetricPoint | None]]
    marks: list[Mark]

    def values(self, name: str, *, per_second: bool = False) -> list[float | None]:
        out: list[float | None] = []
        for _, point in self.slots:
            if point is None:
                out.append(None)
            elif per_second:
                out.append(rate(point, name))
            else:
                out.append(float(getattr(point, name)))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "id": self.ident,
            "start": self.start,
            "end": self.end,
            "span": self.span,
            "series": {
                name: [None if v is None else round(v, 3) for v in self.values(name)] for name in FIGURES[self.kind]
            },
            "marks": [{"time": m.time, "kind": m.kind, "text": m.text} for m in self.marks],
        }


SETTLE = 3
"""Seconds after a slot ends before it is drawn (the recorder's pass writes it right after the boundary)."""


def resolution_for(window: int) -> tuple[str, int]:
    """(stored resolution, drawn span): 10 s up to 6 h (at most ~2,000 points), 5 min up to 2 days, then
    30 min (a 7-day chart has 336 points)."""
    if window <= 6 * 3600:
        return RAW, RAW_SPAN if window <= 3600 else 60
    if window <= 2 * 86_400:
        return DOWN, DOWN_SPAN
    return DOWN, 1800


async def history(nc: NATS, kind: str, ident: str, window: int, now: float) -> History:
    """The series of one env, node or proxy over the last ``window`` seconds: raw points for short windows,
    downsampled ones (plus the raw points of the bucket still open) for long ones; marks for an env."""
    if kind not in KINDS:
        raise HistoryError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    resolution, span = resolution_for(window)
    start = bucket_of(now - window, span)
    end = bucket_of(now - SETTLE, span)  # exclusive: the slot still being measured is not drawn
    gap: float | None = 0.0 if kind == ENV else None
    marks_task = asyncio.ensure_future(read_marks(nc, ident, start)) if kind == ENV else None
    if resolution == RAW:
        points = await read_points(nc, RAW, kind, ident, start)
    else:
        down, tail = await asyncio.gather(
            read_points(nc, DOWN, kind, ident, start),
            read_points(nc, RAW, kind, ident, bucket_of(now, DOWN_SPAN)),
        )
        open_bucket = bucket_of(now, DOWN_SPAN)
        if tail:
            down = [p for p in down if p.time < open_bucket]
            elapsed = max((now - SETTLE - open_bucket) // RAW_SPAN, 1)
            down.append(downsample(tail, open_bucket, slots=elapsed))
        end = open_bucket + DOWN_SPAN if span == DOWN_SPAN else end
        points = down
    if span != (points[0].span if points else span):
        points = regroup(points, span)
    marks = await marks_task if marks_task is not None else []
    return History(kind, ident, start, end, span, dense(points, start, end, span, gap=gap), marks)


def sparkline(values: Sequence[float | None]) -> str:
    """Unicode block sparkline (a space for unknown)."""
    blocks = "▁▂▃▄▅▆▇█"
    known = [v for v in values if v is not None and not math.isnan(v)]
    top = max(known, default=0.0)
    if top <= 0:
        return "".join(" " if v is None else blocks[0] for v in values)
    last = len(blocks) - 1
    return "".join(" " if v is None else blocks[min(int(v / top * last + 0.5), last)] for v in values)


# ------------------------------------------------------------------ per replica (issue 40, "per replica")

REPLICA_LINES = 8
"""At most this many replicas drawn or printed one per line (the rest are counted, and in the env's sums)."""


@dataclass(frozen=True)
class ReplicaSeries:
    """One replica's CPU and memory over a :class:`History`'s slots (None where it did not report: before it
    started, after it stopped, or a gap)."""

    id: str
    node: str
    version: int
    cpu_percent: list[float | None]
    memory_bytes: list[float | None]

    @property
    def label(self) -> str:
        """``…C4E6G8HJ v3 on n1`` (what is known of it)."""
        text = f"…{self.id}" if len(self.id) >= REPLICA_ID else self.id
        if self.version:
            text += f" v{self.version}"
        if self.node:
            text += f" on {self.node}"
        return text

    @property
    def last_seen(self) -> int:
        """Index of the last slot it reported in (-1: none)."""
        return max((i for i, v in enumerate(self.memory_bytes) if v is not None), default=-1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "version": self.version,
            "label": self.label,
            "cpu_percent": [None if v is None else round(v, 3) for v in self.cpu_percent],
            "memory_bytes": [None if v is None else int(v) for v in self.memory_bytes],
        }


def replica_series(history: History) -> list[ReplicaSeries]:
    """The env's replicas over the history's slots, in order of first appearance; labels (node, version) from
    any point of the replica that carries them."""
    n = len(history.slots)
    cpu: dict[str, list[float | None]] = {}
    memory: dict[str, list[float | None]] = {}
    labels: dict[str, tuple[str, int]] = {}
    for index, (_, point) in enumerate(history.slots):
        if point is None:
            continue
        for r in point.replicas:
            if r.id not in cpu:
                cpu[r.id], memory[r.id] = [None] * n, [None] * n
                labels[r.id] = ("", 0)
            cpu[r.id][index] = float(r.cpu_percent)
            memory[r.id][index] = float(r.memory_bytes)
            node, version = labels[r.id]
            labels[r.id] = (r.node or node, r.version or version)
    return [ReplicaSeries(rid, *labels[rid], cpu[rid], memory[rid]) for rid in cpu]


def pick_replicas(series: Sequence[ReplicaSeries], limit: int = REPLICA_LINES) -> tuple[list[ReplicaSeries], int]:
    """The replicas to draw (at most ``limit``) and how many are left out: those still reporting at the end of
    the window first, then those that stopped last; among equals the busiest (mean CPU). Kept in their order of
    first appearance (a line keeps its colour while the set is unchanged)."""
    if len(series) <= limit:
        return list(series), 0

    def busy(s: ReplicaSeries) -> float:
        known = [v for v in s.cpu_percent if v is not None]
        return sum(known) / len(known) if known else 0.0

    ranked = sorted(series, key=lambda s: (-s.last_seen, -busy(s), s.id))[:limit]
    keep = {s.id for s in ranked}
    return [s for s in series if s.id in keep], len(series) - limit


def replicas_as_dict(history: History, limit: int | None = None) -> dict[str, Any]:
    """``{"replicas": [...], "replicas_left_out": n}``: the JSON of the per-replica series (all of them unless
    ``limit``)."""
    every = replica_series(history)
    shown, left_out = pick_replicas(every, limit) if limit is not None else (every, 0)
    return {"replicas": [s.as_dict() for s in shown], "replicas_left_out": left_out}
