"""The proxy end to end on real NATS and real HTTP: routing, errors, balancing, forwarding, heartbeats,
shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.balancer import STICKY_COOKIE
from services.proxy.settings import ROUTES_CACHE_FILE
from services.routes.publisher import RoutesPublisher
from shared.clock import FakeClock
from shared.connection import Connection
from shared.files import write_atomic
from shared.live import proxy_key
from shared.state.feed import StateView
from shared.subjects import LIVE_BUCKET
from shared.tasks import cancel_and_wait
from shared.txn import Writer
from tests.proxy.harness import (
    HOST,
    Backend,
    ProxyFactory,
    Routes,
    endpoint,
    http_route,
    keep_alive_requests,
    serving,
)
from tests.routes import state as S
from tests.waiting import eventually


def url(proxy_port: int, path: str = "/") -> str:
    return f"http://127.0.0.1:{proxy_port}{path}"


async def get(client: aiohttp.ClientSession, port: int, path: str = "/", host: str = HOST) -> tuple[int, str]:
    async with client.get(url(port, path), headers={"Host": host}) as response:
        return response.status, await response.text()


async def test_host_and_longest_prefix_routing(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    root, api, other = Backend("root"), Backend("api"), Backend("other")
    async with serving(root, api, other):
        proxy = await make_proxy()
        await routes.serve(
            proxy,
            http_route(HOST, endpoints=[endpoint(root.addr)]),
            http_route(HOST, endpoints=[endpoint(api.addr)], prefix="/api"),
            http_route("other.example.com", "e2", [endpoint(other.addr)]),
        )
        assert await get(client, proxy.port, "/api/users", host="APP.Example.com:8080") == (200, "api")
        assert await get(client, proxy.port, "/apix") == (200, "api")  # raw string prefix, as the reference
        assert await get(client, proxy.port, "/ap") == (200, "root")
        assert await get(client, proxy.port, "/", host="other.example.com") == (200, "other")


async def test_equal_prefixes_resolve_to_the_first_route_in_snapshot_order(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    first, second = Backend("first"), Backend("second")
    async with serving(first, second):
        proxy = await make_proxy()
        await routes.serve(
            proxy,
            http_route(HOST, "e1", [endpoint(first.addr)], prefix="/x"),
            http_route(HOST, "e2", [endpoint(second.addr)], prefix="/x"),
        )
        assert await get(client, proxy.port, "/x") == (200, "first")


async def test_errors_are_json_404_no_route_and_502_no_healthy_endpoint(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    proxy = await make_proxy()
    await routes.serve(
        proxy,
        http_route(HOST, endpoints=[endpoint("127.0.0.1:9", healthy=False)]),
        http_route("empty.example.com", "e2"),
    )
    for host, status, message in [
        ("nowhere.example.com", 404, "no route for host"),
        (HOST, 502, "no healthy endpoint"),
        ("empty.example.com", 502, "no healthy endpoint"),
    ]:
        async with client.get(url(proxy.port), headers={"Host": host}) as response:
            assert response.status == status
            assert response.content_type == "application/json"
            assert await response.json() == {"error": message}


async def test_upstream_error_is_502_and_in_flight_returns_to_zero(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    proxy = await make_proxy()
    dead = "127.0.0.1:9"  # discard port: nothing listens
    await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(dead)]))
    async with client.get(url(proxy.port), headers={"Host": HOST}) as response:
        assert response.status == 502
        assert await response.json() == {"error": "upstream error"}
    assert proxy.stats.inflight("e1") == 0
    assert proxy.balancer.inflight(dead) == 0


async def test_a_refused_connection_is_retried_on_another_endpoint(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    """A dead endpoint the snapshot still lists (its node not DOWN yet) costs no request: nothing was sent to
    it, so the request goes to another healthy endpoint. Found end to end: the same-node tie-break of P2C
    picked the dead local endpoint for every request until the node was marked DOWN."""
    dead = "127.0.0.1:9"  # discard port: nothing listens
    backend = Backend("alive")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(
            proxy,
            http_route(
                HOST, endpoints=[endpoint(dead, "a1", node_id="n1"), endpoint(backend.addr, "a2", node_id="n2")]
            ),
        )
        results = [await get(client, proxy.port) for _ in range(20)]
        assert results == [(200, "alive")] * 20
        post = await client.post(url(proxy.port, "/echo"), data=b"payload", headers={"Host": HOST})
        assert post.status == 200 and await post.read() == b"payload"  # the body went to the live one whole
        assert proxy.balancer.inflight(dead) == 0
        assert proxy.balancer.inflight(backend.addr) == 0


async def test_upstream_failing_mid_response_truncates_the_client_response(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    backend = Backend("broken")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)]))
        async with client.get(url(proxy.port, "/truncated"), headers={"Host": HOST}) as response:
            assert response.status == 200  # already sent when the upstream broke
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        await eventually(lambda: proxy.stats.inflight("e1") == 0, 5)
        assert proxy.stats.env("e1").completions[-1][1], "counted as a server error"


async def test_an_endpoint_added_at_run_time_reuses_upstream_connections(
    make_proxy: ProxyFactory, routes: Routes
) -> None:
    """1,000 keep-alive requests of one client reach an endpoint that a snapshot added while the proxy ran
    over a handful of upstream connections (the pool), not one each."""
    first, added = Backend("first"), Backend("added")
    async with serving(first, added):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, "e1", [endpoint(first.addr, "a-first")]))
        await routes.serve(proxy, http_route(HOST, "e1", [endpoint(added.addr, "a-added")]))
        statuses = await keep_alive_requests(f"http://127.0.0.1:{proxy.port}/", HOST, 1000)
        assert statuses == [200] * 1000
        assert added.hits == 1000
        assert len(added.peers) <= 4, f"{len(added.peers)} upstream connections for 1,000 keep-alive requests"


async def test_in_flight_decrements_after_a_proxied_request(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    backend = Backend("ok")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)]))
        assert await get(client, proxy.port) == (200, "ok")
        assert proxy.stats.inflight("e1") == 0
        assert proxy.balancer.inflight(backend.addr) == 0


async def test_rate_limit_is_per_client_token_bucket_with_429_json(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    backend = Backend("ok")
    async with serving(backend):
        proxy = await make_proxy()
        limited = http_route(HOST, endpoints=[endpoint(backend.addr)], rate_limit=pb.RateLimit(requests_per_second=1))
        limited_with_burst = http_route(
            "burst.example.com",
            "e2",
            [endpoint(backend.addr)],
            rate_limit=pb.RateLimit(requests_per_second=1, burst=3),
        )
        await routes.serve(proxy, limited, limited_with_burst)
        assert await get(client, proxy.port) == (200, "ok")  # burst 0 = rps: one token
        async with client.get(url(proxy.port), headers={"Host": HOST}) as response:
            assert response.status == 429
            assert response.headers["Retry-After"] == "1"
            assert await response.json() == {"error": "rate limit exceeded"}
        statuses = [(await get(client, proxy.port, host="burst.example.com"))[0] for _ in range(4)]
        assert statuses == [200, 200, 200, 429]  # its own bucket (env|client), full at burst
        assert backend.hits == 4


async def test_forwarding_headers_and_hop_by_hop_stripping(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    backend = Backend("echo")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)]))
        headers = {
            "Host": HOST,
            "Connection": "keep-alive, X-Private",
            "X-Private": "secret",
            "Proxy-Authorization": "Basic eA==",
            "X-Forwarded-For": "203.0.113.9",
            "X-Custom": "kept",
        }
        async with client.post(url(proxy.port, "/echo?q=1"), headers=headers, data=b"payload") as response:
            assert response.status == 200
            assert await response.read() == b"payload"
            seen = {k[len("Seen-") :].lower(): v for k, v in response.headers.items() if k.startswith("Seen-")}
        assert seen["host"] == HOST
        assert seen["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
        assert seen["x-forwarded-proto"] == "http"
        assert seen["x-forwarded-host"] == HOST
        assert seen["x-custom"] == "kept"
        assert "x-private" not in seen and "proxy-authorization" not in seen
        assert backend.seen[-1].query_string == "q=1"

        async with client.get(url(proxy.port, "/stream"), headers={"Host": HOST}) as response:
            assert await response.text() == "chunk0;chunk1;chunk2;chunk3;chunk4;"
            assert "X-Hop" not in response.headers


async def test_request_and_response_bodies_stream_through(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    backend = Backend("echo")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)]))
        payload = bytes(range(256)) * 4096  # 1 MiB

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the proxy forwards it chunked
            for start in range(0, len(payload), 65536):
                yield payload[start : start + 65536]

        async with client.post(url(proxy.port, "/echo"), headers={"Host": HOST}, data=chunks()) as response:
            assert response.status == 200
            assert await response.read() == payload


async def test_p2c_prefers_the_less_loaded_endpoint(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    gate = asyncio.Event()
    busy, idle = Backend("busy", gate=gate), Backend("idle")
    async with serving(busy, idle):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(busy.addr, "a1"), endpoint(idle.addr, "a2")]))
        # Occupy "busy": requests go wherever P2C sends them until one is parked on the busy backend.
        parked: list[asyncio.Task[tuple[int, str]]] = []
        while busy.inflight == 0:
            parked.append(asyncio.create_task(get(client, proxy.port)))
            await eventually(lambda: busy.inflight + idle.hits >= len(parked), 5)
        results = [await get(client, proxy.port) for _ in range(20)]
        assert results == [(200, "idle")] * 20
        assert busy.inflight == 1
        gate.set()
        assert {await task for task in parked} <= {(200, "busy"), (200, "idle")}


async def test_max_concurrency_caps_each_endpoint_and_holds_the_overflow(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    """Reference TestL7ConcurrencyBackpressure: cap 1, one blocked endpoint; a second request is held
    (backpressure), proceeds once the slot frees, and the backend sees both."""
    gate = asyncio.Event()
    backend = Backend("ok", gate=gate)
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)], max_concurrency=1))
        first = asyncio.create_task(get(client, proxy.port))
        await eventually(lambda: backend.inflight == 1, 5)
        second = asyncio.create_task(get(client, proxy.port))
        await eventually(lambda: proxy.holds.held.get("e1") == 1, 5)
        assert backend.hits == 1  # the cap kept the second request off the busy endpoint
        gate.set()
        assert await first == (200, "ok")
        assert await second == (200, "ok")
        assert backend.hits == 2


async def test_max_concurrency_spreads_load_over_endpoints_under_the_cap(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    a, b = Backend("a", gate=gate_a), Backend("b", gate=gate_b)
    async with serving(a, b):
        proxy = await make_proxy()
        await routes.serve(
            proxy, http_route(HOST, endpoints=[endpoint(a.addr, "a1"), endpoint(b.addr, "a2")], max_concurrency=1)
        )
        tasks = [asyncio.create_task(get(client, proxy.port)) for _ in range(3)]
        await eventually(lambda: a.inflight == 1 and b.inflight == 1 and proxy.holds.held.get("e1") == 1, 5)
        gate_b.set()
        gate_a.set()
        assert sorted(await asyncio.gather(*tasks)) in (
            [(200, "a"), (200, "a"), (200, "b")],
            [(200, "a"), (200, "b"), (200, "b")],
        )


async def test_sticky_cookie_pins_an_endpoint(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    a, b = Backend("a"), Backend("b")
    async with serving(a, b):
        proxy = await make_proxy()
        sticky = pb.Middleware(sticky_sessions=True)
        await routes.serve(
            proxy, http_route(HOST, endpoints=[endpoint(a.addr, "a1"), endpoint(b.addr, "a2")], middleware=sticky)
        )
        async with client.get(url(proxy.port), headers={"Host": HOST}) as response:
            pinned = await response.text()
            cookie = response.cookies[STICKY_COOKIE].value
        for _ in range(10):
            async with client.get(
                url(proxy.port), headers={"Host": HOST, "Cookie": f"{STICKY_COOKIE}={cookie}"}
            ) as response:
                assert await response.text() == pinned
                assert STICKY_COOKIE not in response.cookies  # a valid pin is not re-set


async def test_ip_allowlist_and_declared_body_cap(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    backend = Backend("ok")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(
            proxy,
            http_route(
                HOST, endpoints=[endpoint(backend.addr)], middleware=pb.Middleware(ip_allowlist=["10.0.0.0/8", "bad"])
            ),
            http_route(
                "local.example.com",
                "e2",
                [endpoint(backend.addr)],
                middleware=pb.Middleware(ip_allowlist=["127.0.0.1"], max_body_bytes=4),
            ),
        )
        async with client.get(url(proxy.port), headers={"Host": HOST}) as response:
            assert (response.status, await response.json()) == (403, {"error": "forbidden"})
        assert await get(client, proxy.port, host="local.example.com") == (200, "ok")
        async with client.post(url(proxy.port), headers={"Host": "local.example.com"}, data=b"12345") as response:
            assert (response.status, await response.json()) == (413, {"error": "request body too large"})


async def test_heartbeat_reports_inflight_held_rps_latency_and_last_request(
    make_proxy: ProxyFactory, routes: Routes, conn: Connection, client
) -> None:
    gate = asyncio.Event()
    backend = Backend("slow", gate=gate)
    async with serving(backend):
        proxy = await make_proxy(hold_timeout=30)
        await routes.serve(
            proxy,
            http_route(HOST, endpoints=[endpoint(backend.addr)]),
            http_route("cold.example.com", "cold", scale_to_zero=True),
        )
        in_flight = asyncio.create_task(get(client, proxy.port))
        held = asyncio.create_task(get(client, proxy.port, host="cold.example.com"))
        live = await conn.js.key_value(LIVE_BUCKET)

        async def sample(env_id: str) -> cpb.ProxySample | None:
            entry = await live.get(proxy_key("p1"))
            beat = cpb.ProxyHeartbeat.FromString(entry.value or b"")
            assert (beat.proxy_id, beat.node_id) == ("p1", "n1")
            return beat.envs.get(env_id)

        async def reports_busy() -> bool:
            warm, cold = await sample("e1"), await sample("cold")
            return bool(warm and cold and warm.inflight == 1 and warm.rps > 0 and cold.held == 1)

        await eventually(reports_busy, 5, "heartbeat with in-flight 1, rps > 0, held 1")
        beat = cpb.ProxyHeartbeat.FromString((await live.get(proxy_key("p1"))).value or b"")
        assert beat.routes_version == routes.version  # the routes it serves (zattera deploy waits on it)
        warm = await sample("e1")
        assert warm is not None and warm.HasField("last_request_at")
        gate.set()
        assert await in_flight == (200, "slow")

        async def reports_done() -> bool:
            done = await sample("e1")
            return bool(done and done.inflight == 0 and done.latency_p50_ms > 0 and done.error_rate == 0)

        await eventually(reports_done, 5, "heartbeat with the request completed and its latency")
        held.cancel()


async def test_keeps_serving_the_last_snapshot_when_nats_goes_away(nats_server, tmp_path, client) -> None:
    from shared.connection import connect
    from shared.provisioning import provision
    from tests.proxy.harness import start_proxy

    backend = Backend("still-here")
    conn = await connect(nats_server.url, name="test")
    await provision(conn.js)
    async with serving(backend):
        proxy = await start_proxy(nats_server.url, tmp_path / "cache")
        try:
            await Routes(conn).serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)]))
            await proxy.routes.flush()
            await conn.close()
            nats_server.stop()
            proxy_conn = proxy.conn
            assert proxy_conn is not None
            await eventually(lambda: not proxy_conn.nc.is_connected, 10, "proxy sees NATS gone")
            assert await get(client, proxy.port) == (200, "still-here")
        finally:
            await proxy.stop()
        # A restarted proxy serves the cached snapshot before (and without) any NATS connection.
        restarted = await start_proxy(nats_server.url, tmp_path / "cache", connected=False)
        try:
            assert await get(client, restarted.port) == (200, "still-here")
            assert not restarted.connected
        finally:
            await restarted.stop()


async def test_stop_drains_in_flight_requests_and_stops_accepting(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    gate = asyncio.Event()
    backend = Backend("drained", gate=gate)
    async with serving(backend):
        proxy = await make_proxy(shutdown_grace=5)
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)]))
        in_flight = asyncio.create_task(get(client, proxy.port))
        await eventually(lambda: backend.inflight == 1, 5)
        port = proxy.port
        stopping = asyncio.create_task(proxy.stop())
        await eventually(lambda: _refuses(port), 5, "listener closed")
        gate.set()
        assert await in_flight == (200, "drained")
        await stopping


def _refuses(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


async def test_a_connection_closed_for_good_is_replaced_while_routes_keep_being_served(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    """nats-py never reconnects a connection the server dropped over a protocol error: the proxy keeps
    serving its last routes and connects anew, then follows route snapshots again."""
    old, new = Backend("old"), Backend("new")
    async with serving(old, new):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(old.addr)]))
        dropped = proxy.conn
        assert dropped is not None
        await dropped.nc.close()  # closed, not through Connection.close(): as after such a drop
        assert await get(client, proxy.port) == (200, "old")
        await eventually(lambda: proxy.conn not in (None, dropped) and proxy.connected, 10, "a new connection")
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(new.addr)]))
        assert await get(client, proxy.port) == (200, "new")


async def test_a_proxy_that_cached_another_clusters_routes_serves_this_clusters_and_says_which(
    make_proxy: ProxyFactory, conn: Connection, tmp_path: Path, client
) -> None:
    """The data dir of an open cluster started ``--secure``: the proxy's cache holds the old cluster's routes at
    a higher version than any the new cluster will reach for a while; the new cluster's routes win anyway."""
    backend = Backend("new-cluster")
    async with serving(backend):
        host = "api-production.apps.example.com"
        stale = cpb.RouteSnapshot(version=7725, http_routes=[http_route(host, "old-env", [endpoint("127.0.0.1:9")])])
        stale.cluster.CopyFrom(cpb.ClusterIdentity(id="01OPENCLUSTER", epoch="2025-01-01T00:00:00+00:00"))
        write_atomic(tmp_path / "proxy-0" / ROUTES_CACHE_FILE, stale.SerializeToString())
        view = StateView(conn, name="routes")
        await view.start()
        port = int(backend.addr.rpartition(":")[2])
        await S.commit(
            Writer(conn, view),
            S.project(),
            S.app(),
            S.env(),
            S.node(mesh_ip="127.0.0.1"),
            S.healthy_assignment("a1", "relA", port),
        )
        publisher = RoutesPublisher(conn, view, domain=S.DOMAIN, clock=FakeClock())
        task = asyncio.create_task(publisher.run())
        try:
            await asyncio.wait_for(publisher.ready.wait(), 10)
            proxy = await make_proxy()
            await eventually(lambda: proxy.table.cluster == publisher.builder.cluster, 5, "this cluster's routes")
            assert proxy.table.version < stale.version
            assert await get(client, proxy.port, host=host) == (200, "new-cluster")
            live = await conn.js.key_value(LIVE_BUCKET)

            async def reports_this_cluster() -> bool:
                beat = cpb.ProxyHeartbeat.FromString((await live.get(proxy_key("p1"))).value or b"")
                return beat.routes_cluster == publisher.builder.cluster and beat.http_port == proxy.port

            await eventually(reports_this_cluster, 5, "a heartbeat naming this cluster and the proxy's port")
        finally:
            await cancel_and_wait(task)
            await view.stop()
