"""The proxy's pure parts: balancer (reference TestConcurrencyCap), rate limiter, route matching, stats."""

from __future__ import annotations

import random

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.activator import HoldRejected, Holds
from services.proxy.balancer import Balancer, sticky_value
from services.proxy.pipeline.flow import Flow, StepResult, chain
from services.proxy.ratelimit import RateLimiter
from services.proxy.routing import RouteTable, request_host
from services.proxy.stats import LATENCY_WINDOW, ProxyStats, percentiles


class AlwaysZero(random.Random):
    def randrange(self, *args: object, **kwargs: object) -> int:
        return 0


def ep(addr: str, node_id: str = "n1", healthy: bool = True) -> cpb.Endpoint:
    return cpb.Endpoint(assignment_id=f"a-{addr}", node_id=node_id, addr=addr, healthy=healthy)


def test_concurrency_cap() -> None:
    balancer = Balancer("n1", AlwaysZero())
    endpoints = [ep("a:1"), ep("b:2")]
    assert balancer.pick(endpoints, 0) is not None
    balancer.acquire("a:1")
    assert balancer.pick(endpoints, 1) == endpoints[1]
    balancer.acquire("b:2")
    assert balancer.pick(endpoints, 1) is None
    balancer.release("a:1")
    assert balancer.pick(endpoints, 1) == endpoints[0]


def test_p2c_prefers_lower_in_flight_then_the_local_node_then_the_first_pick() -> None:
    balancer = Balancer("n1", AlwaysZero())  # picks i = 0, j = 1
    remote, local = ep("r:1", "n2"), ep("l:1", "n1")
    assert balancer.pick([remote, local]) == local  # tie: this node's endpoint
    balancer.acquire("l:1")
    assert balancer.pick([remote, local]) == remote  # lower in-flight wins over locality
    first, other = ep("x:1", "n2"), ep("y:1", "n3")
    assert balancer.pick([first, other]) == first  # tie, none local: the first pick


def test_p2c_skips_unhealthy_endpoints_and_forgets_idle_counters() -> None:
    balancer = Balancer()
    assert balancer.pick([ep("a:1", healthy=False)]) is None
    healthy = ep("b:1")
    assert balancer.pick([ep("a:1", healthy=False), healthy]) == healthy
    balancer.acquire("b:1")
    balancer.release("b:1")
    assert balancer._inflight == {}


def test_sticky_value_is_base36_fnv1a_of_the_assignment_id() -> None:
    assert sticky_value(cpb.Endpoint(assignment_id="a")) == _base36(0xE40C292C)  # FNV-1a 32 of "a"
    assert sticky_value(cpb.Endpoint(addr="10.0.0.1:80")) == sticky_value(cpb.Endpoint(assignment_id="10.0.0.1:80"))


def _base36(value: int) -> str:
    digits = ""
    while True:
        value, digit = divmod(value, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
        if value == 0:
            return digits


class ManualTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_starts_full_and_refills_at_rps() -> None:
    time = ManualTime()
    limiter = RateLimiter(monotonic=time)
    assert [limiter.allow("e|ip", 2, 3) for _ in range(4)] == [True, True, True, False]
    time.now += 0.5  # one token back at 2/s
    assert [limiter.allow("e|ip", 2, 3) for _ in range(2)] == [True, False]
    assert limiter.allow("e|other-ip", 2, 3)  # separate bucket per key
    time.now += 60
    assert [limiter.allow("e|ip", 2, 3) for _ in range(4)] == [True, True, True, False]  # capped at burst


def test_rate_limiter_sweeps_idle_buckets_then_evicts_the_least_recently_used() -> None:
    time = ManualTime()
    limiter = RateLimiter(max_buckets=2, idle_after=120, monotonic=time)
    limiter.allow("old", 1, 1)
    time.now += 121
    limiter.allow("recent", 1, 1)
    limiter.allow("new", 1, 1)  # full: "old" is idle and swept
    assert len(limiter) == 2
    limiter.allow("recent", 1, 1)  # touch: "new" is now least recently used
    limiter.allow("newest", 1, 1)  # full, nothing idle: evict "new"
    assert not limiter.allow("recent", 1, 1)  # "recent" kept its (empty) bucket
    assert limiter.allow("new", 1, 1)  # "new" was evicted: starts full again


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("App.Example.COM", "app.example.com"),
        ("app.example.com:8080", "app.example.com"),
        ("[::1]:8080", "[::1]"),
        ("[::1]", "[::1]"),
        ("", ""),
    ],
)
def test_request_host_strips_the_port_and_lowercases(header: str, host: str) -> None:
    assert request_host(header) == host


def test_route_table_matching() -> None:
    snapshot = cpb.RouteSnapshot(
        version=3,
        http_routes=[
            cpb.HTTPRoute(hostname="App.example.com", environment_id="root"),
            cpb.HTTPRoute(hostname="app.example.com", path_prefix="/api", environment_id="api"),
            cpb.HTTPRoute(hostname="app.example.com", path_prefix="/api", environment_id="api-second"),
            cpb.HTTPRoute(hostname="app.example.com", path_prefix="/api/v2", environment_id="v2"),
        ],
    )
    table = RouteTable(snapshot)

    def env(path: str, host: str = "app.example.com") -> str | None:
        entry = table.match(host, path)
        return entry.route.environment_id if entry else None

    assert env("/api/v2/x") == "v2"
    assert env("/api/v1") == "api"  # equal prefixes: first in snapshot order
    assert env("/apiary") == "api"  # raw string prefix, no segment boundary
    assert env("/") == "root"
    assert env("/", "other.example.com") is None
    assert table.env_ids == {"root", "api", "api-second", "v2"}


def test_allowlist_accepts_cidrs_and_bare_ips_and_drops_invalid_entries() -> None:
    route = cpb.HTTPRoute(hostname="h")
    route.middleware.ip_allowlist.extend(["10.0.0.0/8", "192.0.2.7", "::1", "not-an-ip"])
    entry = RouteTable(cpb.RouteSnapshot(http_routes=[route])).match("h", "/")
    assert entry is not None
    assert entry.admits("10.1.2.3") and entry.admits("192.0.2.7") and entry.admits("::1")
    assert not entry.admits("192.0.2.8") and not entry.admits("garbage")
    only_invalid = cpb.HTTPRoute(hostname="h")
    only_invalid.middleware.ip_allowlist.append("bad")
    closed = RouteTable(cpb.RouteSnapshot(http_routes=[only_invalid])).match("h", "/")
    assert closed is not None and not closed.admits("10.1.2.3")


def test_percentiles_follow_the_reference_indexing() -> None:
    assert percentiles([]) == (0.0, 0.0)
    assert percentiles([5]) == (5.0, 5.0)
    assert percentiles(list(range(100, 0, -1))) == (51.0, 100.0)


def test_stats_sample_rps_window_latency_ring_error_rate_and_held() -> None:
    time = ManualTime()
    stats = ProxyStats(now=time)
    for index in range(LATENCY_WINDOW + 10):
        stats.begin("e1")
        stats.end("e1", 500 if index < 10 else 200, 0.004)  # the 10 errors fall out of the ring
    stats.begin("e1")
    time.now += 2
    sample = stats.sample({"cold": 2}, routed_envs={"e1", "cold"})
    assert sample["e1"].inflight == 1
    assert sample["e1"].rps == pytest.approx((LATENCY_WINDOW + 11) / 2)
    assert (sample["e1"].latency_p50_ms, sample["e1"].latency_p99_ms) == (4.0, 4.0)
    assert sample["e1"].error_rate == 0.0
    assert sample["e1"].last_request_at.seconds == 100
    assert (sample["cold"].held, sample["cold"].inflight) == (2, 0)
    assert not sample["cold"].HasField("last_request_at")
    stats.end("e1", 503, 0.001)
    time.now += 1
    again = stats.sample({}, routed_envs={"e1"})
    assert again["e1"].rps == 0.0  # the window restarted
    assert again["e1"].error_rate == pytest.approx(1 / LATENCY_WINDOW)
    assert "cold" in again  # reported once more while still known, then forgotten (left the snapshot)
    assert "cold" not in stats.sample({}, routed_envs={"e1"})


async def test_hold_limits_are_checked_before_holding() -> None:
    activations: list[str] = []

    async def activate(env_id: str) -> None:
        activations.append(env_id)

    holds = Holds(activate, max_held_per_env=0, max_body_bytes=10)
    with pytest.raises(HoldRejected) as too_big:
        await holds.hold("e1", 11, lambda: None)
    assert (too_big.value.status, too_big.value.retry_after) == (503, None)
    with pytest.raises(HoldRejected) as full:
        await holds.hold("e1", None, lambda: None)
    assert (full.value.status, full.value.retry_after) == (503, "2")
    assert activations == [] and holds.held == {}


async def test_the_pipeline_runs_its_steps_in_order_until_one_answers() -> None:
    seen: list[str] = []

    def passes(flow: Flow) -> StepResult:
        seen.append("passes")
        return None

    async def waits_then_passes(flow: Flow) -> web.StreamResponse | None:
        seen.append("waits")
        return None

    def answers(flow: Flow) -> StepResult:
        seen.append("answers")
        return web.Response(status=418)

    async def last(flow: Flow) -> web.StreamResponse:
        seen.append("last")
        return web.Response(status=200)

    request = make_mocked_request("GET", "/x", headers={"Host": "App.example.com:8080"})
    handler = chain([passes, lambda flow: waits_then_passes(flow), passes], last)
    assert (await handler(request)).status == 200
    assert seen == ["passes", "waits", "passes", "last"]
    seen.clear()
    assert (await chain([passes, answers, passes], last)(request)).status == 418
    assert seen == ["passes", "answers"]

    hosts: list[tuple[str, str]] = []

    def records(flow: Flow) -> StepResult:
        hosts.append((flow.host, flow.path))
        return None

    await chain([records], last)(request)
    assert hosts == [("app.example.com", "/x")]


def test_a_route_entry_reads_its_route_once() -> None:
    route = cpb.HTTPRoute(hostname="h", environment_id="e1", endpoints=[ep("a:1")])
    plain = RouteTable(cpb.RouteSnapshot(http_routes=[route])).match("h", "/")
    assert plain is not None
    assert (plain.env_id, plain.middleware, plain.users, plain.rate_limit) == ("e1", None, {}, None)
    assert not plain.weighted and not plain.pinned
    route.middleware.sticky_sessions = True
    route.middleware.basic_auth_username, route.middleware.basic_auth_password_hash = "u", "hash"
    route.rate_limit.requests_per_second = 5
    sticky = RouteTable(cpb.RouteSnapshot(http_routes=[route])).match("h", "/")
    assert sticky is not None and sticky.pinned and not sticky.weighted
    assert sticky.users == {"u": "hash"} and sticky.rate_limit == (5, 5)
    route.ClearField("middleware")
    route.endpoints[0].step_tag = "dep.0"
    route.rate_limit.burst = 9
    canary = RouteTable(cpb.RouteSnapshot(http_routes=[route])).match("h", "/")
    assert canary is not None and canary.weighted and canary.pinned and canary.rate_limit == (5, 9)
