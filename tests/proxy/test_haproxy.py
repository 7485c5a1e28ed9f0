"""The HAProxy data plane (``--engine haproxy``) end to end: a real HAProxy per test (its own free port and
directory), driven by route snapshots on real NATS; the Python hold handler behind it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import bcrypt
import pytest
from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.balancer import STICKY_COOKIE, sticky_value
from services.proxy.haproxy_engine import HAProxyIngress, haproxy_binary, haproxy_ingress
from shared.live import proxy_key
from shared.natsio import LIVE_BUCKET, Connection
from tests.proxy.harness import HOST, Backend, Routes, endpoint, http_route, serving, settings
from tests.proxy.test_hold import Responder
from tests.waiting import eventually

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (make system-packages)")

IngressFactory = Callable[..., Awaitable[HAProxyIngress]]


@pytest.fixture
async def make_ingress(nats_url: str, tmp_path: Path) -> AsyncIterator[IngressFactory]:
    started: list[HAProxyIngress] = []

    async def make(
        cache_dir: Path | None = None, url: str = nats_url, connected: bool = True, **overrides: Any
    ) -> HAProxyIngress:
        ingress = haproxy_ingress(
            settings(**overrides), nats_url=url, cache_dir=cache_dir or tmp_path / f"i{len(started)}"
        )
        await ingress.start()
        started.append(ingress)
        if connected:
            await asyncio.wait_for(ingress.proxy.wait_connected(), 10)
        return ingress

    yield make
    for ingress in started:
        await ingress.stop()


async def serve(routes: Routes, ingress: HAProxyIngress, *route: cpb.HTTPRoute) -> None:
    version = await routes.publish(*route)
    await eventually(lambda: ingress.version == version, 30, f"haproxy on routes version {version}")


def url(ingress: HAProxyIngress, path: str = "/") -> str:
    return f"http://127.0.0.1:{ingress.layout.bind.rpartition(':')[2]}{path}"


async def get(
    client: aiohttp.ClientSession, ingress: HAProxyIngress, host: str = HOST, **kwargs: Any
) -> tuple[int, str]:
    async with client.get(url(ingress), headers={"Host": host, **kwargs.pop("headers", {})}, **kwargs) as response:
        return response.status, await response.text()


@pytest.fixture
async def fresh() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that opens a connection per request (an old worker never answers after a reload)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


async def test_routes_10000_hosts_and_changes_endpoints_at_run_time(
    make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession
) -> None:
    first, second = Backend("first"), Backend("second")
    async with serving(first, second):
        ingress = await make_ingress()
        many = [http_route(f"h{i}.example.com", f"e{i}", [endpoint(first.addr, f"a{i}")]) for i in range(10_000)]
        await serve(routes, ingress, *many)
        assert await get(fresh, ingress, "H9999.example.com:8080") == (200, "first")
        async with fresh.get(url(ingress), headers={"Host": "unknown.example.com"}) as response:
            assert (response.status, await response.json()) == (404, {"error": "no route for host"})
        reloads = ingress.engine.reloads
        many[9999] = http_route("h9999.example.com", "e9999", [endpoint(second.addr, "b1")])
        many.append(http_route("new.example.com", "e9999", [endpoint(second.addr, "b1")]))
        await serve(routes, ingress, *many)
        assert await get(fresh, ingress, "h9999.example.com") == (200, "second")
        assert await get(fresh, ingress, "new.example.com") == (200, "second")
        assert ingress.engine.reloads == reloads  # servers and hosts changed through the runtime API


async def test_route_changes_finish_in_flight_requests(
    make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession
) -> None:
    """An endpoint leaving (runtime change) and a new env (reload) both let the request in flight finish."""
    gate = asyncio.Event()
    old, new = Backend("old", gate=gate), Backend("new")
    async with serving(old, new):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(old.addr, "a-old")]))
        in_flight = asyncio.create_task(get(fresh, ingress))
        await eventually(lambda: old.inflight == 1, 5, "request in flight on the old endpoint")
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(new.addr, "a-new")]))
        assert await get(fresh, ingress) == (200, "new")
        await serve(
            routes,
            ingress,
            http_route(HOST, "e1", [endpoint(new.addr, "a-new")]),
            http_route("other.example.com", "e2", [endpoint(new.addr, "a-2")]),
        )
        assert ingress.engine.reloads >= 1
        assert await get(fresh, ingress, "other.example.com") == (200, "new")
        gate.set()
        assert await asyncio.wait_for(in_flight, 5) == (200, "old")


async def test_cold_env_is_held_by_python_and_activated(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    backend = Backend("awake")
    responder = await Responder(conn).start()
    async with serving(backend):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", scale_to_zero=True))
        reloads = ingress.engine.reloads
        held = asyncio.create_task(get(fresh, ingress))
        await eventually(lambda: ingress.proxy.holds.held.get("e1") == 1, 5, "request held by the Python handler")
        await eventually(lambda: len(responder.requests) == 1, 5, "one Activate request")
        await routes.publish(http_route(HOST, "e1", [endpoint(backend.addr)], scale_to_zero=True))
        assert await asyncio.wait_for(held, 5) == (200, "awake")
        await eventually(lambda: ingress.version == routes.version, 5, "warm routes in haproxy")
        assert await get(fresh, ingress) == (200, "awake")
        assert ingress.proxy.holds.completed_holds == 1  # the warm request did not pass through Python
        assert ingress.engine.reloads == reloads  # warming up is a runtime change (the backend was kept)


async def test_heartbeat_carries_haproxy_samples(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    gate = asyncio.Event()
    backend = Backend("slow", gate=gate)
    async with serving(backend):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(backend.addr)]))
        in_flight = asyncio.create_task(get(fresh, ingress))
        live = await conn.js.key_value(LIVE_BUCKET)

        async def busy() -> bool:
            entry = await live.get(proxy_key("p1"))
            sample = cpb.ProxyHeartbeat.FromString(entry.value or b"").envs.get("e1")
            return bool(sample and sample.inflight == 1 and sample.rps > 0 and sample.HasField("last_request_at"))

        await eventually(busy, 10, "heartbeat with HAProxy's in-flight 1 and rps > 0 for e1")
        gate.set()
        assert await in_flight == (200, "slow")


async def test_restarted_after_kill_and_serves_cached_routes_without_nats(
    make_ingress: IngressFactory, routes: Routes, tmp_path: Path, fresh: aiohttp.ClientSession
) -> None:
    backend = Backend("cached")
    async with serving(backend):
        first = await make_ingress(cache_dir=tmp_path / "cache")
        await serve(routes, first, http_route(HOST, "e1", [endpoint(backend.addr)]))
        await eventually(lambda: first.proxy.routes.version == routes.version, 5, "snapshot cached")
        await first.stop()
        # Nothing listens there: the control plane is down; the cached routes are served anyway.
        again = await make_ingress(cache_dir=tmp_path / "cache", url="nats://127.0.0.1:1", connected=False)
        assert await get(fresh, again) == (200, "cached")
        pid = again.engine.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: again.engine.restarts == 1, 20, "haproxy restarted by its supervisor")
        assert await get(fresh, again) == (200, "cached")


async def test_middleware(make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession) -> None:
    """Every middleware of the Python proxy, enforced by HAProxy (basic auth by the Python handler)."""
    one, two = Backend("one"), Backend("two")
    password_hash = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
    async with serving(one, two):
        ingress = await make_ingress()
        both = [endpoint(one.addr, "a-one"), endpoint(two.addr, "a-two")]
        await serve(
            routes,
            ingress,
            http_route("deny.example.com", "e1", both, middleware=pb.Middleware(ip_allowlist=["10.0.0.0/8", "bad"])),
            http_route("allow.example.com", "e2", both, middleware=pb.Middleware(ip_allowlist=["127.0.0.1"])),
            http_route("tls.example.com", "e3", both, middleware=pb.Middleware(redirect_https=True)),
            http_route("limited.example.com", "e4", both, rate_limit=pb.RateLimit(requests_per_second=1, burst=2)),
            http_route("capped.example.com", "e5", both, middleware=pb.Middleware(max_body_bytes=4)),
            http_route("sticky.example.com", "e6", both, middleware=pb.Middleware(sticky_sessions=True)),
            http_route(
                "auth.example.com",
                "e7",
                both,
                middleware=pb.Middleware(basic_auth_username="ann", basic_auth_password_hash=password_hash),
            ),
            http_route("retry.example.com", "e8", [endpoint("127.0.0.1:1", "a-dead"), endpoint(one.addr, "a-one")]),
        )
        async with fresh.get(url(ingress), headers={"Host": "deny.example.com"}) as response:
            assert (response.status, await response.json()) == (403, {"error": "forbidden"})
        assert (await get(fresh, ingress, "allow.example.com"))[0] == 200

        async with fresh.get(url(ingress, "/p?q=1"), headers={"Host": "tls.example.com"}, allow_redirects=False) as r:
            assert (r.status, r.headers["Location"]) == (308, "https://tls.example.com/p?q=1")
        forwarded = {"X-Forwarded-Proto": "https"}
        assert (await get(fresh, ingress, "tls.example.com", headers=forwarded))[0] == 200

        statuses = [(await get(fresh, ingress, "limited.example.com"))[0] for _ in range(4)]
        assert statuses[:2] == [200, 200] and 429 in statuses[2:]

        async with fresh.post(url(ingress), headers={"Host": "capped.example.com"}, data=b"12345") as response:
            assert (response.status, await response.json()) == (413, {"error": "request body too large"})
        async with fresh.post(url(ingress), headers={"Host": "capped.example.com"}, data=b"1234") as response:
            assert response.status == 200

        async with fresh.get(url(ingress), headers={"Host": "sticky.example.com"}) as response:
            pinned = response.cookies[STICKY_COOKIE].value
            first_name = await response.text()
        named = {sticky_value(e): b.name for e, b in zip(both, (one, two), strict=True)}
        assert named[pinned] == first_name
        cookie = {"Cookie": f"{STICKY_COOKIE}={pinned}"}
        assert {(await get(fresh, ingress, "sticky.example.com", headers=cookie))[1] for _ in range(6)} == {first_name}

        assert (await get(fresh, ingress, "auth.example.com"))[0] == 401
        good = {"Authorization": "Basic " + base64.b64encode(b"ann:secret").decode()}
        assert (await get(fresh, ingress, "auth.example.com", headers=good))[0] == 200
        assert all("Authorization" not in request.headers for request in one.seen + two.seen)

        assert [await get(fresh, ingress, "retry.example.com") for _ in range(4)] == [(200, "one")] * 4


NAME = web.AppKey("name", str)


async def _echo(request: web.Request) -> web.WebSocketResponse:
    socket = web.WebSocketResponse()
    await socket.prepare(request)
    async for message in socket:
        await socket.send_str(f"{request.app[NAME]}:{message.data}")
    return socket


@contextlib.asynccontextmanager
async def echo_server(name: str) -> AsyncIterator[tuple[str, web.AppRunner]]:
    app = web.Application()
    app[NAME] = name
    app.router.add_get("/ws", _echo)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}", runner
    finally:
        await runner.cleanup()


async def test_websocket_survives_red_green_and_closes_with_its_replica(
    make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession
) -> None:
    async with echo_server("blue") as (blue, blue_runner), echo_server("green") as (green, _):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(blue, "a-blue")]))
        socket = await fresh.ws_connect(url(ingress, "/ws"), headers={"Host": HOST})
        await socket.send_str("1")
        assert (await socket.receive_str(timeout=5)) == "blue:1"
        # Promote green (runtime change: blue to maintenance) and add an env (a reload: a new worker).
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(green, "a-green")]))
        await serve(
            routes,
            ingress,
            http_route(HOST, "e1", [endpoint(green, "a-green")]),
            http_route("other.example.com", "e2", [endpoint(green, "a-other")]),
        )
        assert ingress.engine.reloads >= 1
        await socket.send_str("2")
        assert (await socket.receive_str(timeout=5)) == "blue:2"  # the open WebSocket stays on blue
        newcomer = await fresh.ws_connect(url(ingress, "/ws"), headers={"Host": HOST})
        await newcomer.send_str("3")
        assert (await newcomer.receive_str(timeout=5)) == "green:3"
        await blue_runner.cleanup()  # blue stops after the drain window: its WebSockets are closed cleanly
        closing = await socket.receive(timeout=5)
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        await newcomer.close()
        await socket.close()


async def test_bad_input_does_not_affect_other_clients(
    make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession
) -> None:
    backend = Backend("fine")
    async with serving(backend):
        ingress = await make_ingress(header_timeout=1.0)
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(backend.addr)]))
        port = int(ingress.layout.bind.rpartition(":")[2])
        # A slowloris-style client: a request head that never ends.
        slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)
        slow_writer.write(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode())
        await slow_writer.drain()
        assert await get(fresh, ingress, "bad host with spaces") == (404, '{"error":"no route for host"}')
        async with fresh.get(url(ingress), headers={"Host": HOST, "X-Big": "x" * 40_000}) as response:
            assert response.status in (400, 431)
        assert await get(fresh, ingress) == (200, "fine")  # others are served meanwhile
        answer = await asyncio.wait_for(slow_reader.read(), 10)  # closed after the header timeout
        assert answer.startswith(b"HTTP/1.1 408") and backend.hits == 1
        slow_writer.close()
