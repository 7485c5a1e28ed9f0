"""Pure tests of the metrics history: points from heartbeats (counters differenced per reporter), idle
envs, downsampling, dense series, --since parsing and the sparkline (a fake clock's times, no NATS)."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared import history as H
from shared import history_read as HR
from shared.clock import FakeClock
from tests.autoscale.helpers import node_beat, proxy_beat

T0 = 1_700_000_000.0


def sample(requests: int, ok: int = 0, client: int = 0, server: int = 0, **kw: float) -> cpb.ProxySample:
    return cpb.ProxySample(
        requests_total=requests,
        responses_2xx_total=ok,
        responses_4xx_total=client,
        responses_5xx_total=server,
        **kw,  # type: ignore[arg-type]
    )


def facts(**envs: tuple[int, int]) -> dict[str, H.EnvFacts]:
    return {env_id: H.EnvFacts(desired, running) for env_id, (desired, running) in envs.items()}


def test_counters_are_differenced_per_reporter_into_exact_rates_and_counts() -> None:
    clock = FakeClock(T0)
    rec = H.Recorder()
    first = rec.points(
        clock.now(), {}, [proxy_beat(T0, envs={"e1": sample(100, 90, 5, 5, rps=7.0)})], facts(e1=(2, 2)), {}
    )
    assert first[H.subject(H.RAW, H.ENV, "e1")].rps == pytest.approx(7.0)  # first sight: the proxy's own rate
    later = T0 + 10
    points = rec.points(
        later,
        {},
        [proxy_beat(later, envs={"e1": sample(350, 320, 10, 20, latency_p50_ms=12, latency_p99_ms=80)})],
        facts(e1=(2, 2)),
        {},
    )
    p = points[H.subject(H.RAW, H.ENV, "e1")]
    assert p.rps == pytest.approx(25.0)
    assert (p.responses_2xx, p.responses_4xx, p.responses_5xx) == (230, 5, 15)
    assert p.time == int(later // 10 * 10) - 10 and p.span == 10  # the slot that just ended
    assert (p.desired, p.running) == (2, 2)
    assert p.latency_p50_ms == pytest.approx(12) and p.latency_p99_ms == pytest.approx(80)
    assert points[H.subject(H.RAW, H.PROXY, "p1")].rps == pytest.approx(25.0)


def test_a_proxy_restart_counts_from_zero_and_two_proxies_add_up() -> None:
    rec = H.Recorder()
    rec.points(
        T0,
        {},
        [proxy_beat(T0, "p1", {"e1": sample(1000)}), proxy_beat(T0, "p2", {"e1": sample(10)})],
        facts(e1=(1, 1)),
        {},
    )
    t = T0 + 10
    points = rec.points(
        t,
        {},
        [proxy_beat(t, "p1", {"e1": sample(50, 50)}), proxy_beat(t, "p2", {"e1": sample(110, 100)})],
        facts(e1=(1, 1)),
        {},
    )
    p = points[H.subject(H.RAW, H.ENV, "e1")]
    assert p.rps == pytest.approx(5.0 + 10.0)
    assert p.responses_2xx == 150


def test_node_heartbeats_make_node_points_and_env_usage() -> None:
    rec = H.Recorder()
    hb = node_beat(T0, "n1", instances={"a1": (30.0, 100), "a2": (20.0, 50), "other": (5.0, 1)})
    hb.cpu_percent, hb.memory_used_bytes, hb.memory_total_bytes = 42.0, 1000, 4000
    hb.disk_used_bytes, hb.disk_total_bytes = 10, 100
    points = rec.points(T0, {"n1": hb}, [], facts(e1=(2, 2)), {"a1": "e1", "a2": "e1"})
    node = points[H.subject(H.RAW, H.NODE, "n1")]
    assert (node.cpu_percent, node.memory_bytes, node.instances, node.disk_used_bytes) == (42.0, 1000, 3, 10)
    env = points[H.subject(H.RAW, H.ENV, "e1")]
    assert env.cpu_percent == pytest.approx(50.0) and env.memory_bytes == 150


def test_an_idle_env_writes_one_zero_point_then_nothing() -> None:
    rec = H.Recorder()
    name = H.subject(H.RAW, H.ENV, "e1")
    assert name not in rec.points(T0, {}, [], facts(e1=(0, 0)), {})
    assert name in rec.points(T0 + 10, {}, [], facts(e1=(1, 1)), {})
    assert name in rec.points(T0 + 20, {}, [], facts(e1=(0, 0)), {})  # the drop to zero is recorded
    assert name not in rec.points(T0 + 30, {}, [], facts(e1=(0, 0)), {})


def test_downsampling_averages_rates_over_the_span_and_adds_counts() -> None:
    start = 1_700_000_100  # a 5-min boundary
    raw = [
        cpb.MetricPoint(
            time=start + 10 * i,
            span=10,
            rps=30.0,
            responses_2xx=300,
            latency_p50_ms=10,
            latency_p99_ms=50 + i,
            desired=2,
            running=1 + i % 2,
            cpu_percent=60.0,
            memory_bytes=100 + i,
        )
        for i in range(15)
    ]  # half the span idle (no points)
    down = H.downsample(raw, start)
    assert down.time == start and down.span == 300 and down.samples == 15
    assert down.rps == pytest.approx(15.0)
    assert down.responses_2xx == 4500
    assert down.latency_p50_ms == pytest.approx(10) and down.latency_p99_ms == 64
    assert (down.desired, down.running, down.memory_bytes) == (2, 2, 114)
    assert down.cpu_percent == pytest.approx(30.0)


def test_the_downsampler_emits_a_bucket_when_the_clock_crosses_its_end() -> None:
    clock = FakeClock(1_700_000_100.0)
    ds = H.Downsampler()
    name = H.subject(H.RAW, H.ENV, "e1")
    emitted: dict[str, cpb.MetricPoint] = {}
    for _ in range(31):
        now = clock.now()
        emitted.update(ds.add({name: cpb.MetricPoint(time=int(now), span=10, rps=6.0)}, now))
        clock.set(now + 10)
    down = emitted[H.subject(H.DOWN, H.ENV, "e1")]
    assert down.time == 1_700_000_100 and down.samples == 30 and down.rps == pytest.approx(6.0)


def test_dense_fills_env_gaps_with_zero_and_regroup_keeps_the_mean() -> None:
    pts = [cpb.MetricPoint(time=1_700_000_100 + 300 * i, span=300, rps=float(i)) for i in range(6)]
    dense = H.dense(pts[:2], 1_700_000_100, 1_700_000_100 + 900, 300)
    assert [p.rps if p else None for _, p in dense] == [0.0, 1.0, 0.0]
    node_dense = H.dense(pts[:1], 1_700_000_100, 1_700_000_100 + 600, 300, gap=None)
    assert node_dense[1][1] is None
    grouped = H.regroup(pts, 1800)
    assert len(grouped) in (1, 2)
    assert sum(g.rps * g.span for g in grouped) == pytest.approx(sum(p.rps * 300 for p in pts))


@pytest.mark.parametrize("text,seconds", [("1h", 3600), ("90s", 90), ("7d", 604800), ("15m", 900)])
def test_since_parses(text: str, seconds: int) -> None:
    assert HR.parse_since(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1w", "-1h", "31d", "0m"])
def test_bad_since_names_the_field(text: str) -> None:
    with pytest.raises(H.HistoryError, match="--since"):
        HR.parse_since(text)


def test_sparkline() -> None:
    assert HR.sparkline([0, 1, 2, None, 4]) == "▁▃▅ █"
    assert HR.sparkline([0, 0]) == "▁▁"


def test_resolution_for_windows() -> None:
    assert HR.resolution_for(3600) == (H.RAW, 10)
    assert HR.resolution_for(86400) == (H.DOWN, 300)
    assert HR.resolution_for(7 * 86400) == (H.DOWN, 1800)
