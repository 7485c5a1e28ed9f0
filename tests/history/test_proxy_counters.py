"""The proxies' counters the history is built from (issue 40): totals since the proxy started by status
class, p95, open connections — from the Python data path and from HAProxy's stats (a reload zeroing
HAProxy's own counters does not make the totals go down)."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.haproxy_stats import HAProxySampler, merge_samples
from services.proxy.stats import ProxyStats
from shared.clock import FakeClock


def test_the_python_path_counts_totals_by_class_p95_and_connections() -> None:
    clock = FakeClock(1_000.0)
    stats = ProxyStats(now=clock.now)
    for status in (200, 200, 204, 404, 500, 503):
        stats.begin("e1")
        stats.end("e1", status, 0.010)
    for latency in range(100):
        stats.begin("e2")
        stats.end("e2", 200, latency / 1000)
    stats.begin("e1")  # still in flight
    hb = stats.heartbeat("p1", "n1", {}, {"e1", "e2"})
    e1 = hb.envs["e1"]
    assert (e1.requests_total, e1.responses_2xx_total, e1.responses_4xx_total, e1.responses_5xx_total) == (7, 3, 1, 2)
    assert hb.envs["e2"].latency_p95_ms == 95 and hb.envs["e2"].latency_p99_ms == 99
    assert hb.connections == 1
    again = stats.heartbeat("p1", "n1", {}, {"e1", "e2"})
    assert again.envs["e1"].requests_total == 7  # totals, not per interval


def row(backend: str, stot: int, ok: int, server_errors: int) -> dict[str, str]:
    return {
        "pxname": backend,
        "svname": "BACKEND",
        "stot": str(stot),
        "hrsp_2xx": str(ok),
        "hrsp_5xx": str(server_errors),
        "ttime": "7",
    }


def test_haproxy_totals_add_the_deltas_across_a_reload() -> None:
    sampler = HAProxySampler(now=0.0)
    first = sampler.sample([row("b1", 10, 8, 2)], {"b1": "e1"}, 1.0)["e1"]
    assert (first.requests_total, first.responses_2xx_total, first.responses_5xx_total) == (10, 8, 2)
    reloaded = sampler.sample([row("b1", 3, 3, 0)], {"b1": "e1"}, 2.0)["e1"]  # HAProxy's counters restarted
    assert (reloaded.requests_total, reloaded.responses_2xx_total, reloaded.responses_5xx_total) == (13, 11, 2)
    assert reloaded.latency_p95_ms == 7
    merged = merge_samples({"e1": reloaded}, {"e1": cpb.ProxySample(requests_total=5, responses_2xx_total=5)})
    assert merged["e1"].requests_total == 18 and merged["e1"].responses_2xx_total == 16
