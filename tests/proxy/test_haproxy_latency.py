"""Real latency percentiles on the HAProxy data plane (issues 40 and 41), from HAProxy's request log: a real
HAProxy per test, real upstreams with known latencies, heartbeats read back from real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.haproxy_config import LATENCY_RING, Plan, Server
from services.proxy.haproxy_config import Backend as PlanBackend
from services.proxy.haproxy_engine import HAProxyEngine
from services.proxy.haproxy_latency import (
    LOG_EVERY_MAX,
    Latencies,
    LatencyLog,
    Owners,
    _Lines,
    log_every,
    log_every_commands,
)
from services.proxy.haproxy_runtime import command
from services.proxy.launch import haproxy_binary
from shared.canary import LATENCY_BOUNDS_MS, Figures, Side, aggregate, judge, latency_ratio
from shared.connection import Connection
from shared.history import EnvFacts, Recorder
from tests.proxy.harness import HOST, Routes, endpoint, http_route, last_heartbeat
from tests.proxy.test_haproxy import IngressFactory, make_ingress, serve, url
from tests.waiting import eventually

__all__ = ["make_ingress"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (make system-packages)")


# ------------------------------------------------------------------ pure


def _plan() -> Plan:
    servers = (
        Server("s_a", "127.0.0.1:1", 100, 0, "c1", release_id="stable", step_tag="dep.0"),
        Server("s_b", "127.0.0.1:2", 100, 0, "c2", release_id="canary", step_tag="dep.0"),
    )
    weighted = PlanBackend("env_w", "e1", (), True, servers)
    plain = PlanBackend("env_p", "e2", (), False, (Server("s_c", "127.0.0.1:3", 100, 0, "c3"),))
    return Plan({}, (), {"env_w": weighted, "env_p": plain}, {"env_w": "e1", "env_p": "e2"})


def test_log_lines_feed_env_percentiles_and_release_histograms() -> None:
    latencies = Latencies()
    owners = Owners.of(_plan())
    lines = [f"env_p s_c 200 {ms}" for ms in range(1, 101)]
    lines += ["env_w s_a 200 10", "env_w s_b 503 400", "env_w s_b 101 90000"]  # a WebSocket: not a latency
    lines += ["hold python 200 5", "no_route <NOSRV> 404 0", "-", "env_p s_c 200 -1", "env_p s_c x 3", "", "a b"]
    latencies.feed("\n".join(lines).encode() + b"\n", owners)
    assert latencies.percentiles()["e2"] == (51.0, 96.0, 100.0)
    assert latencies.percentiles()["e1"] == (400.0, 400.0, 400.0)
    [canary] = [t for t in latencies.releases.report() if t.release_id == "canary"]
    assert (canary.environment_id, canary.step_tag, canary.requests, canary.errors_5xx) == ("e1", "dep.0", 1, 1)
    assert len(canary.latency_buckets) == len(LATENCY_BOUNDS_MS) + 1 and sum(canary.latency_buckets) == 1
    assert latencies.releases.buckets("e1", "canary", "dep.0") == list(canary.latency_buckets)
    assert latencies.lines == 102
    latencies.forget({"e1"})
    assert set(latencies.percentiles()) == {"e1"}


@pytest.mark.parametrize(
    ("rates", "applied", "expected"),
    [
        ({"b": 255.0}, {}, {}),  # below twice the lines: every request
        ({"b": 256.0}, {}, {"b": 2}),
        ({"b": 1000.0}, {}, {"b": 4}),  # the largest power of two keeping >= 128 lines/s (1000 / 4 = 250)
        ({"b": 1e9}, {}, {"b": LOG_EVERY_MAX}),
        ({"b": 1000.0, "w": 1e6}, {}, {"b": 4}),  # the weighted (exact) backend always logs everything
        ({"b": 1100.0}, {"b": 8}, {"b": 8}),  # one step away from what is applied: kept
        ({"b": 1100.0}, {"b": 4}, {"b": 4}),
        ({"b": 1100.0}, {"b": 2}, {"b": 8}),  # two steps away: moved
        ({"b": 5000.0}, {"b": 2}, {"b": 32}),  # further: moved
        ({"b": 100.0}, {"b": 8}, {}),  # quiet again: every request
    ],
)
def test_a_busy_backend_logs_one_request_in_a_power_of_two(
    rates: dict[str, float], applied: dict[str, int], expected: dict[str, int]
) -> None:
    assert log_every(rates, {"w"}, applied) == expected
    assert log_every(rates, set(), applied, lines=0) == {}


def test_the_map_commands_add_set_and_delete_entries() -> None:
    path = Path("/x/log-every.map")
    commands = log_every_commands(path, {"a": 2, "b": 4, "c": 8}, {"a": 2, "b": 16, "d": 4})
    assert commands == [
        ("set map /x/log-every.map b 16", "b", 16),
        ("add map /x/log-every.map d 4", "d", 4),
        ("del map /x/log-every.map c", "c", 0),
    ]


def test_the_window_keeps_the_last_512_and_memory_stays_fixed() -> None:
    latencies = Latencies()
    owners = Owners.of(_plan())
    latencies.feed(b"".join(b"env_p s_c 200 1000\n" for _ in range(600)), owners)
    latencies.feed(b"".join(b"env_p s_c 200 2\n" for _ in range(512)), owners)
    assert latencies.percentiles()["e2"] == (2.0, 2.0, 2.0)


def test_lines_split_across_reads_are_joined_and_runaway_bytes_dropped() -> None:
    lines = _Lines()
    got = [lines.whole(b"env_p s_c 2"), lines.whole(b"00 7\nenv_p s"), lines.whole(b"_c 200 8\n")]
    assert b"".join(got) == b"env_p s_c 200 7\nenv_p s_c 200 8\n"
    assert lines.whole(b"x" * 1000) == b""  # never a line of ours
    assert lines.whole(b"\nenv_p s_c 200 9\n") == b"\nenv_p s_c 200 9\n"


# ------------------------------------------------------------------ real HAProxy


@asynccontextmanager
async def timed(name: str, slow_every: int, slow_ms: float, fast_ms: float) -> AsyncIterator[str]:
    """An upstream answering ``name`` after ``fast_ms``, every ``slow_every``-th request after ``slow_ms``."""
    count = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal count
        count += 1
        await asyncio.sleep((slow_ms if slow_every and count % slow_every == 0 else fast_ms) / 1000)
        return web.Response(text=name)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def load(target: str, requests: int, concurrency: int = 16, path: str = "/", **headers: str) -> None:
    """``requests`` requests, ``concurrency`` at a time, each client without a cookie (drawn afresh)."""
    jar = aiohttp.DummyCookieJar()
    async with aiohttp.ClientSession(cookie_jar=jar, connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one() -> None:
            async with session.get(target + path.lstrip("/"), headers={"Host": HOST, **headers}) as response:
                assert response.status == 200
                await response.read()

        await asyncio.gather(*(one() for _ in range(requests)))


def weighted(addr: str, release: str, share: int) -> cpb.Endpoint:
    return cpb.Endpoint(
        assignment_id=f"a-{release}",
        node_id="n1",
        addr=addr,
        healthy=True,
        release_id=release,
        release_weight=share,
        step_tag="dep.0",
    )


async def test_a_canary_with_the_stable_average_but_a_far_higher_p99_is_a_p99_breach(
    make_ingress: IngressFactory, routes: Routes, conn: Connection
) -> None:
    # Stable: every request 30 ms. Canary: 3 % of requests 600 ms, the rest 12 ms: average ~30 ms.
    async with timed("stable", 0, 0, 30) as stable, timed("canary", 33, 600, 12) as canary:
        ingress = await make_ingress()
        route = http_route(HOST, "e1", [weighted(stable, "rel1", 5000), weighted(canary, "rel2", 5000)])
        await serve(routes, ingress, route)
        await load(url(ingress), 800, concurrency=32)

        async def figures() -> Figures:
            return aggregate([await last_heartbeat(conn)], "e1", "dep.0", "rel2", "rel1")

        async def counted() -> bool:
            seen = await figures()
            return seen.canary.requests >= 300 and sum(seen.canary.buckets) >= 300 and sum(seen.stable.buckets) >= 300

        await eventually(counted, 15, "both releases' requests and logged latencies in a heartbeat")
        seen = await figures()
        spec = pb.CanarySpec(min_requests=100, max_error_ratio=0.01, max_latency_ratio=1.5)
        verdict = judge(spec, seen)
        assert seen.canary.latency_kind == "p99" and seen.canary.latency_ms >= 500, seen
        assert seen.stable.latency_kind == "p99" and seen.stable.latency_ms < 300, seen  # (a loaded machine's jitter)
        assert verdict.breach.startswith("p99 latency"), verdict
        # What the averages said (HAProxy's stats, as before): no breach.
        averages = Figures(
            Side(seen.canary.requests, 0, (), seen.canary.avg_ms),
            Side(seen.stable.requests, 0, (), seen.stable.avg_ms),
            1,
        )
        assert latency_ratio(averages) < 1.5, averages


async def test_history_p50_is_below_p99_for_a_spread_latency(
    make_ingress: IngressFactory, routes: Routes, conn: Connection
) -> None:
    async with timed("app", 10, 300, 2) as upstream:  # 10 % of requests at 300 ms, the rest at 2 ms
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(upstream)]))
        await load(url(ingress), 400, concurrency=16)

        async def spread() -> bool:
            sample = (await last_heartbeat(conn)).envs.get("e1")
            return sample is not None and sample.latency_p99_ms >= 300

        await eventually(spread, 15, "a heartbeat with the logged latencies of e1")
        hb = await last_heartbeat(conn)
        sample = hb.envs["e1"]
        assert 2 * sample.latency_p50_ms < 300 <= sample.latency_p95_ms <= sample.latency_p99_ms, sample
        # The metrics history's point (issue 40) from that heartbeat: real percentiles, not the average.
        at = hb.time.seconds + 10.0
        points = Recorder().points(at, {}, [hb], {"e1": EnvFacts(desired=1, running=1)}, {})
        [point] = [p for name, p in points.items() if name.endswith(".env.e1")]
        assert point.latency_p50_ms < point.latency_p95_ms <= point.latency_p99_ms, point
        assert 2 * point.latency_p50_ms < 300 <= point.latency_p99_ms, point


async def test_the_log_survives_a_lost_socket_and_a_reload_and_never_holds_requests(
    make_ingress: IngressFactory, routes: Routes
) -> None:
    async with timed("app", 0, 0, 0) as upstream, timed("other", 0, 0, 0) as other:
        ingress = await make_ingress(latency_log_lines=0)  # every request logged: the test counts lines
        engine = ingress.engine
        latency_log = engine.latency_log
        assert latency_log is not None
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(upstream)]))
        await load(url(ingress), 50)
        await eventually(lambda: latency_log.latencies.lines >= 50, 10, "50 logged requests")
        # The socket goes away: requests are served all the same (HAProxy never waits for its log), their
        # lines wait in HAProxy's ring, and the next sample listens again and gets them.
        await latency_log.stop()
        before = latency_log.latencies.lines
        await asyncio.wait_for(load(url(ingress), 300), 20)
        await engine.samples()  # (or the heartbeat's, whichever comes first)
        assert latency_log.rebinds >= 1
        await eventually(lambda: latency_log.latencies.lines >= before + 300, 15, "the ring's lines after the rebind")
        # A reload (a structure change: another env's backend): the new worker's lines arrive too.
        reloads = engine.reloads
        await serve(
            routes,
            ingress,
            http_route(HOST, "e1", [endpoint(upstream)]),
            http_route("b.example", "e2", [endpoint(other)]),
        )
        assert engine.reloads == reloads + 1
        before = latency_log.latencies.lines
        await load(url(ingress), 50)
        await eventually(lambda: latency_log.latencies.lines >= before + 50, 10, "lines after the reload")


async def settled_lines(latency_log: LatencyLog) -> int:
    """The lines counted once HAProxy has forwarded everything (two reads 0.2 s apart agree)."""
    counts: list[int] = []

    async def settled() -> bool:
        latency_log.drain()
        counts.append(latency_log.latencies.lines)
        await asyncio.sleep(0.2)
        latency_log.drain()
        return latency_log.latencies.lines == counts[-1]

    await eventually(settled, 15, "the request log settled")
    return latency_log.latencies.lines


async def test_a_busy_backend_logs_one_request_in_n_and_a_canarys_every_request(
    make_ingress: IngressFactory, routes: Routes
) -> None:
    async with timed("app", 0, 0, 0) as upstream, timed("s", 0, 0, 0) as stable, timed("c", 0, 0, 0) as canary:
        # No heartbeat of its own: the rates are those between this test's samples.
        ingress = await make_ingress(latency_log_lines=50, heartbeat_interval=3600)
        engine, latency_log = ingress.engine, ingress.engine.latency_log
        assert latency_log is not None
        plain = http_route(HOST, "e1", [endpoint(upstream)])
        canary_route = http_route("w.example", "e2", [weighted(stable, "rel1", 5000), weighted(canary, "rel2", 5000)])
        await serve(routes, ingress, plain, canary_route)
        await engine.samples()  # the rates' baseline
        await load(url(ingress), 400)
        await load(url(ingress), 400, Host="w.example")
        await engine.samples()  # both backends well above 2 x 50 requests/s
        [(busy, n)] = engine.log_every.applied.items()  # the plain env's backend; never the weighted one
        assert engine.running.env_of_backend[busy] == "e1" and n >= 2
        shown = await command(ingress.layout.stats_socket, f"show map {ingress.layout.log_every_map}")
        assert f" {busy} {n}" in shown, shown
        # Now one request in n of e1 is logged; every one of the canary's, whatever its rate.
        before = await settled_lines(latency_log)
        await load(url(ingress), 32 * n)  # 32 lines expected
        logged = await settled_lines(latency_log) - before
        assert 8 <= logged <= 96 and "e1" in latency_log.percentiles({"e1"}), (logged, n)
        releases = latency_log.latencies.releases

        def canary_counted() -> int:
            return sum(sum(releases.buckets("e2", release, "dep.0")) for release in ("rel1", "rel2"))

        already = canary_counted()
        await load(url(ingress), 300, Host="w.example")
        await settled_lines(latency_log)
        assert canary_counted() - already == 300
        # A reload (another env's backend comes) starts the new worker with the map as applied.
        reloads = engine.reloads
        await serve(routes, ingress, plain, canary_route, http_route("b.example", "e3", [endpoint(upstream)]))
        assert engine.reloads == reloads + 1
        shown = await command(ingress.layout.stats_socket, f"show map {ingress.layout.log_every_map}")
        assert f" {busy} {n}" in shown, shown


async def test_no_url_query_header_or_client_address_is_logged(
    make_ingress: IngressFactory, routes: Routes, tmp_path: Path
) -> None:
    async with timed("app", 0, 0, 0) as upstream:
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(upstream, "asg1")]))
        await load(url(ingress), 5, path="/private/path?token=s3cr3t-query", Authorization="Bearer s3cr3t-header")
        # A connection error (a bad request head): its line names nobody either.
        reader, writer = await asyncio.open_connection("127.0.0.1", int(ingress.layout.bind.rpartition(":")[2]))
        writer.write(b"GARBAGE s3cr3t\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()
        ring = await command(ingress.layout.stats_socket, f"show events {LATENCY_RING}")
        lines = [line for line in ring.splitlines() if line.strip()]
        assert len([line for line in lines if line.startswith("env_")]) == 5, ring
        for forbidden in ("s3cr3t", "private", "127.0.0.1", "token", "Bearer", HOST):
            assert forbidden not in ring, ring


async def test_off_keeps_the_averages_and_opens_no_socket(
    make_ingress: IngressFactory, routes: Routes, conn: Connection
) -> None:
    async with timed("app", 10, 100, 2) as upstream:
        ingress = await make_ingress(latency_log=False)
        assert ingress.engine.latency_log is None
        assert LATENCY_RING not in ingress.layout.config_file.read_text()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(upstream)]))
        await load(url(ingress), 100)

        async def averaged() -> bool:
            sample = (await last_heartbeat(conn)).envs.get("e1")
            return sample is not None and sample.latency_p99_ms > 0

        await eventually(averaged, 15, "a heartbeat of e1")
        sample = (await last_heartbeat(conn)).envs["e1"]
        assert sample.latency_p50_ms == sample.latency_p99_ms  # HAProxy's average in both


async def test_one_request_in_n_is_logged_when_sampled(make_ingress: IngressFactory, routes: Routes) -> None:
    async with timed("app", 0, 0, 0) as upstream:
        # Only the configured 1 in 4: with heartbeats every 0.1 s, a burst of 200 reads as a busy backend, and
        # the adaptive one in N (log_every) would thin the lines further at random.
        ingress = await make_ingress(latency_log_sample=4, latency_log_lines=0)
        latency_log = ingress.engine.latency_log
        assert latency_log is not None
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(upstream)]))
        await load(url(ingress), 200)
        await eventually(lambda: latency_log.latencies.lines >= 50, 10, "one line per 4 requests")
        await asyncio.wait_for(latency_log.ensure(), 5)
        assert latency_log.latencies.lines == 50
        assert "sample 1:4" in ingress.layout.config_file.read_text()


def test_engine_has_no_log_unless_the_layout_says_so(tmp_path: Path) -> None:
    from services.proxy.haproxy_config import Layout

    layout = Layout(tmp_path, "127.0.0.1:1", "127.0.0.1:2", 1.0, 1.0)
    assert HAProxyEngine(layout, node_id="n1").latency_log is None
