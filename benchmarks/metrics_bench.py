"""Metrics history benchmark (issue 40): the recorder loop's cost at 1,000 envs on 10 nodes, the storage it
takes per env per day, and the env page with 24 h of history.

``python -m benchmarks.metrics_bench [--full]``. A real nats-server (store on the real disk):

* the loop: 1,000 envs (2 replicas each on 10 nodes, 200 instances per node heartbeat) and 2 proxies
  reporting every env, in a live view filled directly; the recorder's passes driven by a fake clock,
  10 s apart, across a 5-min boundary (32 passes quick, 62 full). Figures: CPU per pass (process time:
  computing the points and publishing them), wall time per pass, and the CPU share of one core at one pass
  every 10 s; the passes run twice over fresh streams, first without the per-replica series (the baseline
  of their added cost), then as the loop runs;
* storage: the bytes the two streams hold after those passes (JetStream's own count: payload, subject,
  headers and its per-message record), extrapolated to a day (8,640 raw passes, 288 downsampled ones) —
  per env and for the cluster, every env busy (the worst case: an idle env stores nothing after one zero
  point), and what the per-replica CPU and memory add per env;
* the env page: ``GET /env/<id>?window=1h|24h|7d`` server time with the history each window reads (1 h:
  360 10-s points; 24 h: 288 5-min points, the open bucket's 10-s points and 12 marks; 7 d: 2,016 5-min
  points; each point with its 2 replicas), among 1,000 envs (20 loads quick, 50 full; target ≤ 300 ms at
  24 h). The console is started as ``console_bench`` starts it (``benchmarks/console_rig.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, percentile, row
from benchmarks.console_rig import bench_console, bench_state, logged_in, seed_envs
from services.autoscale.history import HistoryRecorder
from shared import history as H
from shared import keys as K
from shared.clock import FakeClock, stamp
from shared.connection import Connection
from shared.live import LiveView, node_key, proxy_key
from shared.loop import LoopDeps
from shared.state.feed import StateView

ENVS = 1_000
NODES = 10
REPLICAS = 2
START = 1_700_000_100.0  # a 5-min boundary


def _replicas(i: int, env: pb.Environment, release: pb.Release) -> list[tuple[Message, str | None]]:
    """The env's replicas, running and healthy, on nodes ``n<i+r>``."""
    made: list[tuple[Message, str | None]] = []
    for r in range(REPLICAS):
        a = pb.Assignment(environment_id=env.meta.id, release_id=release.meta.id, node_id=f"n{(i + r) % NODES}")
        a.meta.id = f"01BENCHASG{i:05d}{r}"
        a.desired = pb.ASSIGNMENT_DESIRED_RUN
        made.append((a, None))
        made.append((pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY), K.observed(a.node_id, a.meta.id)))
    return made


def _env_id(i: int) -> str:
    return f"01JD5Q8ZKX3V7W9YB2C{i:07d}"  # ids as long as real ones (26 characters)


def _beats(now: float, step: int, env_ids: list[str]) -> list[tuple[str, bytes]]:
    """Every node's and proxy's heartbeat at ``now`` (counters growing ``step`` times)."""
    beats: list[tuple[str, bytes]] = []
    for n in range(NODES):
        hb = cpb.Heartbeat(node_id=f"n{n}", cpu_percent=35.0, memory_used_bytes=6 << 30, memory_total_bytes=16 << 30)
        hb.disk_used_bytes, hb.disk_total_bytes = 40 << 30, 200 << 30
        stamp(hb.time, now)
        for i in range(len(env_ids)):
            for r in range(REPLICAS):
                if (i + r) % NODES == n:
                    hb.instances[f"01BENCHASG{i:05d}{r}"].CopyFrom(
                        cpb.InstanceSample(cpu_percent=12.5, memory_bytes=80 << 20)
                    )
        beats.append((node_key(hb.node_id), hb.SerializeToString()))
    for p in range(2):
        phb = cpb.ProxyHeartbeat(proxy_id=f"p{p}", node_id=f"n{p}", connections=400)
        stamp(phb.time, now)
        for env_id in env_ids:
            requests = 50 * step
            phb.envs[env_id].CopyFrom(
                cpb.ProxySample(
                    inflight=1,
                    rps=5.0,
                    latency_p50_ms=12,
                    latency_p95_ms=40,
                    latency_p99_ms=80,
                    requests_total=requests,
                    responses_2xx_total=requests - step,
                    responses_5xx_total=step,
                )
            )
        beats.append((proxy_key(phb.proxy_id), phb.SerializeToString()))
    return beats


async def _stream_bytes(conn: Connection) -> tuple[int, int, int, int]:
    raw = await conn.js.stream_info(H.METRICS_STREAM)
    down = await conn.js.stream_info(H.METRICS_5M_STREAM)
    return raw.state.bytes, raw.state.messages, down.state.bytes, down.state.messages


class _NoReplicas(H.ReplicaRecorder):
    """The loop as it was before per-replica series: the baseline of their added cost."""

    def add(self, *args: Any, **kwargs: Any) -> None:
        return None


@dataclass(frozen=True)
class _LoopRun:
    cpu: list[float]
    """CPU ms of each steady pass."""
    wall: list[float]
    raw_bytes: int
    raw_msgs: int
    day_raw: float
    day_down: float


async def _loop_run(conn: Connection, view: StateView, env_ids: list[str], passes: int, *, replicas: bool) -> _LoopRun:
    """The recorder's passes over fresh streams; what they stored, extrapolated to a day."""
    for stream in (H.METRICS_STREAM, H.METRICS_5M_STREAM):
        with contextlib.suppress(Exception):
            await conn.js.purge_stream(stream)
    clock = FakeClock(START)
    live = LiveView(None, clock)
    recorder = HistoryRecorder(LoopDeps(conn, view, clock), live=live)
    recorder.on_term_start()
    if not replicas:
        recorder.replicas = _NoReplicas()
    await recorder.ensure_streams()
    cpu: list[float] = []
    wall: list[float] = []
    for step in range(passes):
        for key, data in _beats(clock.now(), step, env_ids):
            live.apply(key, data)
        before_cpu = time.process_time()
        before = time.perf_counter()
        await recorder.pass_once()
        wall.append((time.perf_counter() - before) * 1000)
        cpu.append((time.process_time() - before_cpu) * 1000)
        clock.set(clock.now() + H.RAW_SPAN)
    raw_bytes, raw_msgs, down_bytes, down_msgs = await _stream_bytes(conn)
    # the downsampled stream holds one 5-min pass (plus the partial first bucket's): per 5-min pass
    down_passes = max(down_msgs // (ENVS + NODES + 2), 1)
    raw_per_pass = raw_bytes / (passes - 1)  # the term's first pass writes nothing
    down_per_pass = down_bytes / down_passes
    # the first pass only reads the counters
    return _LoopRun(cpu[2:] or cpu, wall[2:] or wall, raw_bytes, raw_msgs, raw_per_pass * 8_640, down_per_pass * 288)


async def _loop(conn: Connection, view: StateView, env_ids: list[str], passes: int) -> list[Row]:
    base = await _loop_run(conn, view, env_ids, passes, replicas=False)
    run = await _loop_run(conn, view, env_ids, passes, replicas=True)
    subjects = ENVS + NODES + 2
    day_raw, day_down, steady = run.day_raw, run.day_down, run.cpu
    per_env_day = (day_raw + day_down) / subjects
    added = (day_raw + day_down - base.day_raw - base.day_down) / ENVS
    return [
        row(f"loop: CPU per pass, {ENVS:,} envs on {NODES} nodes (p50)", median(steady), "ms", "", "points + publish"),
        row(f"loop: CPU per pass, {ENVS:,} envs on {NODES} nodes (p99)", percentile(steady, 99), "ms"),
        row("loop: wall time per pass (p50)", median(run.wall), "ms", "≤ 10,000 ms (the slot)"),
        row("loop: CPU share of one core (a pass every 10 s)", median(steady) / 10_000 * 100, "%"),
        row("loop: CPU per pass without per-replica series (p50)", median(base.cpu), "ms", "", "the baseline"),
        row("storage: bytes per stored 10-s point", run.raw_bytes / max(run.raw_msgs, 1), "B", "", "JetStream's count"),
        row(
            "storage: bytes per stored 10-s point without per-replica series",
            base.raw_bytes / max(base.raw_msgs, 1),
            "B",
            "",
            "the baseline",
        ),
        row("storage: raw series per env per day (24 h kept)", day_raw / subjects, "B"),
        row("storage: 5-min series per env per day (30 d kept)", day_down / subjects, "B"),
        row("storage: per busy env per day, both series", per_env_day, "B"),
        row(f"storage: added per busy env per day by per-replica series ({REPLICAS} replicas)", added, "B"),
        row(f"storage: cluster of {ENVS:,} busy envs, per day written", day_raw + day_down, "B"),
        row(
            f"storage: cluster of {ENVS:,} busy envs, held (24 h raw + 30 d 5-min)",
            day_raw + 30 * day_down,
            "B",
            "",
            "per stream replica",
        ),
    ]


def metric_point(t: int, span: int, i: int) -> bytes:
    return cpb.MetricPoint(
        time=t,
        span=span,
        rps=20 + (i % 60) / 6,
        responses_2xx=19 * span,
        responses_5xx=i % 7,
        latency_p50_ms=12,
        latency_p95_ms=40,
        latency_p99_ms=90,
        inflight=2,
        desired=2,
        running=2,
        cpu_percent=25,
        memory_bytes=160 << 20,
        samples=30 if span == H.DOWN_SPAN else 0,
        replicas=[
            cpb.ReplicaUsage(
                id=f"BENCHRE{r}",
                cpu_percent=12.5,
                memory_bytes=80 << 20,
                node=f"n{r}" if span == H.DOWN_SPAN or t % H.DOWN_SPAN == 0 else "",
                version=1 if span == H.DOWN_SPAN or t % H.DOWN_SPAN == 0 else 0,
                samples=30 if span == H.DOWN_SPAN else 0,
            )
            for r in range(REPLICAS)
        ],
    ).SerializeToString()


async def _seed_history(conn: Connection, env_ids: dict[str, str], now: float) -> None:
    """What each window's page reads, as it would find it: the stream's own time of a message is when it was
    stored, and a read starts there (``start_time``), so points seeded at once would all be read by every
    window. One env per window instead, holding exactly what that window reads: 1 h → 360 10-s points;
    24 h → 288 5-min points and the open bucket's 10-s points (≤ 30); 7 d → 2,016 5-min points and those."""
    pending: list[Any] = []

    async def publish(subject: str, data: bytes) -> None:
        pending.append(conn.js.publish(subject, data))
        if len(pending) >= 500:
            await asyncio.gather(*pending)
            pending.clear()

    open_bucket = H.bucket_of(now, H.DOWN_SPAN)
    for window, env_id in env_ids.items():
        if window == "1h":
            first = H.bucket_of(now - 3600, H.RAW_SPAN)
            for i in range(360):
                await publish(H.subject(H.RAW, H.ENV, env_id), metric_point(first + i * H.RAW_SPAN, H.RAW_SPAN, i))
        else:
            days = 1 if window == "24h" else 7
            buckets = 288 * days
            for i in range(buckets):
                t = open_bucket - (buckets - i) * H.DOWN_SPAN
                await publish(H.subject(H.DOWN, H.ENV, env_id), metric_point(t, H.DOWN_SPAN, i))
            for i in range(int(now - open_bucket) // H.RAW_SPAN):
                await publish(
                    H.subject(H.RAW, H.ENV, env_id), metric_point(open_bucket + i * H.RAW_SPAN, H.RAW_SPAN, i)
                )
        for i in range(1 if window == "1h" else 12 * days):
            at = now - i * 7_200
            await publish(H.mark_subject(env_id), H.mark_of(at, "deploy.succeeded", f"release v{i}"))
    await asyncio.gather(*pending)


async def _page_times(url: str, env_ids: dict[str, str], loads: int) -> dict[str, list[float]]:
    async with logged_in(url) as http:
        times: dict[str, list[float]] = {}
        for window in ("1h", "24h", "7d"):
            for _ in range(loads):
                started = time.perf_counter()
                async with http.get(f"{url}/env/{env_ids[window]}?window={window}") as page:
                    body = await page.read()
                times.setdefault(window, []).append((time.perf_counter() - started) * 1000)
            assert b'id="chart-requests"' in body and b'id="chart-replica-cpu"' in body
        return times


async def _bench(url: str, passes: int, loads: int) -> list[Row]:
    async with bench_state(url) as bench:
        conn, view = bench.conn, bench.view
        env_ids = await seed_envs(bench.writer, ENVS, _env_id, min_replicas=REPLICAS, extra=_replicas)
        rows = await _loop(conn, view, env_ids, passes)
        # the page: a fresh env id's subjects (the loop's fake-clock points are years old to the page)
        page_envs = {"1h": env_ids[0], "24h": env_ids[1], "7d": env_ids[2]}
        await conn.js.purge_stream(H.METRICS_STREAM)
        await conn.js.purge_stream(H.METRICS_5M_STREAM)
        await _seed_history(conn, page_envs, time.time())
        async with bench_console(bench) as console:
            times = await _page_times(console.url, page_envs, loads)
        for window, samples in times.items():
            target = "≤ 300 ms" if window == "24h" else ""
            rows.append(
                row(f"env page with history, window {window}, server time (p50)", median(samples), "ms", target)
            )
            rows.append(
                row(f"env page with history, window {window}, server time (p99)", percentile(samples, 99), "ms", target)
            )
        return rows


def run(quick: bool = True) -> list[Row]:
    passes, loads = (32, 20) if quick else (62, 50)
    with embedded_server("zattera-metrics-bench-") as server:
        return asyncio.run(_bench(server.url, passes, loads))


if __name__ == "__main__":
    bench_main("Metrics history", run, __doc__, "62 passes, 50 loads")
