"""The proxies' canary pieces (issue 41), pure: the Python engine's weighted draw and its per-release
counters, HAProxy's server weights and the counters read from its server rows."""

from __future__ import annotations

import random
from collections import Counter

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.balancer import Balancer, weighted
from services.proxy.haproxy_plan import MAX_WEIGHT, canary_weights
from services.proxy.haproxy_stats import ServerTraffic
from services.proxy.stats import ProxyStats
from shared.canary import LATENCY_BOUNDS_MS, bucket_of, percentile_ms


def endpoint(addr: str, release: str, share: int, tag: str = "d.0") -> cpb.Endpoint:
    return cpb.Endpoint(
        assignment_id=addr, addr=addr, healthy=True, release_id=release, release_weight=share, step_tag=tag
    )


def canary_route(canary_bps: int) -> list[cpb.Endpoint]:
    return [
        endpoint("s1:1", "stable", 10_000 - canary_bps),
        endpoint("s2:1", "stable", 10_000 - canary_bps),
        endpoint("c1:1", "canary", canary_bps),
    ]


def test_the_python_draw_follows_the_release_shares_not_the_endpoint_counts() -> None:
    balancer = Balancer(rng=random.Random(7))
    endpoints = canary_route(500)
    assert weighted(endpoints) and not weighted([cpb.Endpoint(addr="a:1", healthy=True)])
    picks = Counter(balancer.pick_weighted(endpoints).release_id for _ in range(20_000))  # type: ignore[union-attr]
    assert abs(picks["canary"] / 20_000 - 0.05) < 0.01


def test_haproxy_server_weights_split_each_release_share_over_its_servers() -> None:
    for bps in (100, 500, 2500, 5000):
        weights = canary_weights(canary_route(bps))
        assert max(weights.values()) <= MAX_WEIGHT and weights["s1:1"] == weights["s2:1"]
        share = weights["c1:1"] / sum(weights.values())
        assert abs(share - bps / 10_000) < 0.001, (bps, weights)
    assert canary_weights(canary_route(500)) == {"s1:1": 247, "s2:1": 247, "c1:1": 26}  # 26/520 = 5 % exactly


def test_python_counters_by_release_and_step() -> None:
    stats = ProxyStats(now=lambda: 100.0)
    canary = endpoint("c1:1", "canary", 500)
    for status, seconds in ((200, 0.004), (500, 0.2), (200, 0.004)):
        stats.begin("env")
        stats.end("env", status, seconds, canary)
    stats.begin("env")
    stats.end("env", 200, 0.01, cpb.Endpoint(addr="plain:1"))  # an unweighted route: not counted
    [traffic] = stats.heartbeat("p1", "n1", {}, {"env"}).release_traffic
    assert (traffic.release_id, traffic.step_tag, traffic.requests, traffic.errors_5xx) == ("canary", "d.0", 3, 1)
    assert len(traffic.latency_buckets) == len(LATENCY_BOUNDS_MS) + 1
    assert traffic.latency_buckets[bucket_of(200)] == 1 and percentile_ms(list(traffic.latency_buckets)) == 200


def test_haproxy_counters_start_at_the_first_sample_of_a_step_and_survive_a_reload() -> None:
    counters = ServerTraffic()
    owners = {("b", "s1"): ("env", "canary", "d.0")}
    counters.sample([{"pxname": "b", "svname": "s1", "stot": "100", "hrsp_5xx": "3", "rtime": "8"}], owners)
    assert counters.report[0].requests == 0  # what came before the step is not its own
    counters.sample([{"pxname": "b", "svname": "s1", "stot": "150", "hrsp_5xx": "5", "rtime": "8"}], owners)
    assert (counters.report[0].requests, counters.report[0].errors_5xx, counters.report[0].latency_avg_ms) == (
        50,
        2,
        8.0,
    )
    counters.sample([{"pxname": "b", "svname": "s1", "stot": "10", "hrsp_5xx": "0", "rtime": "8"}], owners)
    assert counters.report[0].requests == 10  # a reload zeroed HAProxy's counters: counted from zero
