"""What a proxy tells the orchestrator's drain (issue 42): per env, the requests and connections still in
flight to endpoints its routes no longer list (``old_inflight``), and whether that count is complete
(``drain_counts``) — on both data paths (the Python proxy, HAProxy), real NATS, real upstreams."""

from __future__ import annotations

import asyncio

import aiohttp

from services.proxy.balancer import Balancer
from shared.connection import Connection
from tests.proxy.harness import HOST, Backend, ProxyFactory, Routes, endpoint, http_route, last_heartbeat, serving
from tests.proxy.test_haproxy import IngressFactory, echo_server, fresh, get, make_ingress, serve, url
from tests.waiting import eventually

__all__ = ["fresh", "make_ingress"]  # fixtures used below


async def reports(conn: Connection, expected: dict[str, int], complete: bool = True) -> bool:
    hb = await last_heartbeat(conn)
    return dict(hb.old_inflight) == expected and hb.drain_counts is complete


def test_the_balancer_counts_per_env_what_goes_to_addresses_no_longer_routed() -> None:
    balancer = Balancer()
    balancer.acquire("10.0.0.1:80", "e1")
    balancer.acquire("10.0.0.1:80", "e1")
    balancer.acquire("10.0.0.2:80", "e1")
    balancer.acquire("10.0.0.3:80", "e2")
    routed = {"e1": {"10.0.0.2:80"}, "e2": {"10.0.0.3:80"}}
    assert balancer.old_inflight(lambda env: routed.get(env, set())) == {"e1": 2}
    balancer.release("10.0.0.1:80")
    balancer.release("10.0.0.1:80")
    assert balancer.old_inflight(lambda env: routed.get(env, set())) == {}


async def test_the_python_proxy_counts_a_request_in_flight_to_an_endpoint_no_longer_routed(
    make_proxy: ProxyFactory, routes: Routes, conn: Connection
) -> None:
    gate = asyncio.Event()
    blue, green = Backend("blue", gate=gate), Backend("green")
    async with serving(blue), serving(green), aiohttp.ClientSession() as client:
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, "e1", [endpoint(blue.addr, "a-blue")]))

        async def call() -> tuple[int, str]:
            async with client.get(f"http://127.0.0.1:{proxy.port}/", headers={"Host": HOST}) as r:
                return r.status, await r.text()

        slow = asyncio.create_task(call())
        await eventually(lambda: blue.inflight == 1, 5, "a request in flight to blue")
        await eventually(lambda: reports(conn, {}), 10, "nothing old in flight while blue is routed")
        await routes.serve(proxy, http_route(HOST, "e1", [endpoint(green.addr, "a-green")]))  # the promotion
        await eventually(lambda: reports(conn, {"e1": 1}), 10, "one request in flight to the old release")
        assert await call() == (200, "green")
        gate.set()
        assert await slow == (200, "blue")
        await eventually(lambda: reports(conn, {}), 10, "nothing in flight to the old release any more")


async def test_haproxy_counts_a_websocket_held_by_the_old_release_until_it_closes(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    async with echo_server("blue") as (blue, _), echo_server("green") as (green, _):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(blue, "a-blue")]))
        socket = await fresh.ws_connect(url(ingress, "/ws"), headers={"Host": HOST})
        await socket.send_str("1")
        assert (await socket.receive_str(timeout=5)) == "blue:1"
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(green, "a-green")]))  # runtime change
        await eventually(lambda: reports(conn, {"e1": 1}), 10, "the WebSocket to the old release counted")
        assert (await get(fresh, ingress))[0] in (200, 404)  # new requests go to green
        await socket.close()
        await eventually(lambda: reports(conn, {}), 15, "nothing in flight to the old release once it closed")


async def test_haproxy_counts_are_incomplete_while_a_worker_from_before_a_reload_holds_connections(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    async with echo_server("blue") as (blue, _), echo_server("green") as (green, _):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(blue, "a-blue")]))
        socket = await fresh.ws_connect(url(ingress, "/ws"), headers={"Host": HOST})
        await socket.send_str("1")
        assert (await socket.receive_str(timeout=5)) == "blue:1"
        reloads = ingress.engine.reloads
        await serve(  # a new env: a reload, the old worker keeps the WebSocket
            routes,
            ingress,
            http_route(HOST, "e1", [endpoint(green, "a-green")]),
            http_route("other.example.com", "e2", [endpoint(green, "a-other")]),
        )
        assert ingress.engine.reloads > reloads
        await eventually(lambda: reports(conn, {}, complete=False), 10, "counts marked incomplete")
        await socket.close()
        await eventually(lambda: reports(conn, {}), 15, "complete again once the old worker is gone")
