"""Hold-and-activate through the proxy on real NATS: the reference's proxy/activator tests (autoscale.md
§6.6) plus single flight, retries and shutdown. The activation responder is a real subscriber on
``zattera.activate`` answering with the real wire format."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import Connection
from shared.subjects import ACTIVATE_SUBJECT
from tests.proxy.harness import Backend, ProxyFactory, Routes, dying_upstream, endpoint, http_route, serving
from tests.waiting import eventually

COLD_HOST = "app"


class Responder:
    """Answers ``zattera.activate`` like the autoscale activator, recording requests; ``on_activate``
    runs once per request (the test's stand-in for the control plane bringing a replica up)."""

    def __init__(self, conn: Connection, on_activate: Callable[[], Awaitable[None]] | None = None) -> None:
        self.conn = conn
        self.requests: list[cpb.ActivateRequest] = []
        self.on_activate = on_activate

    async def start(self) -> Responder:
        async def on_msg(msg: Msg) -> None:
            self.requests.append(cpb.ActivateRequest.FromString(msg.data))
            if self.on_activate is not None:
                await self.on_activate()
            await msg.respond(cpb.ActivateResponse(accepted=True).SerializeToString())

        await self.conn.nc.subscribe(ACTIVATE_SUBJECT, cb=on_msg)
        await self.conn.nc.flush()  # twice: nats-py's first PING can overtake the buffered SUB
        await self.conn.nc.flush()
        return self


def cold_route() -> cpb.HTTPRoute:
    return http_route(COLD_HOST, "e1", scale_to_zero=True)


async def request(
    client: aiohttp.ClientSession, port: int, method: str = "GET", data: bytes | None = None
) -> tuple[int, dict[str, str], str]:
    async with client.request(method, f"http://127.0.0.1:{port}/", headers={"Host": COLD_HOST}, data=data) as response:
        return response.status, dict(response.headers), await response.text()


async def test_park_activate_flush(make_proxy: ProxyFactory, routes: Routes, conn: Connection, client) -> None:
    """Held requests trigger exactly one Activate (single flight), then all proceed when a snapshot
    with an endpoint arrives."""
    backend = Backend("awake")
    responder = await Responder(conn).start()
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, cold_route())
        held = [asyncio.create_task(request(client, proxy.port)) for _ in range(3)]
        await eventually(lambda: proxy.holds.held.get("e1") == 3, 5, "three requests held")
        await eventually(lambda: len(responder.requests) == 1, 5, "one Activate request")
        assert (responder.requests[0].environment_id, responder.requests[0].node_id) == ("e1", "n1")
        await routes.publish(http_route(COLD_HOST, "e1", [endpoint(backend.addr)], scale_to_zero=True))
        results = await asyncio.wait_for(asyncio.gather(*held), 5)
        assert [(status, body) for status, _, body in results] == [(200, "awake")] * 3
        assert len(responder.requests) == 1
        assert proxy.holds.held == {}
        assert proxy.holds.completed_holds == 3


async def test_l7_wakes_and_proxies(make_proxy: ProxyFactory, routes: Routes, conn: Connection, client) -> None:
    """The activation itself brings the endpoint: the responder publishes the warm snapshot."""
    backend = Backend("awake")
    async with serving(backend):

        async def warm_up() -> None:
            await routes.publish(http_route(COLD_HOST, "e1", [endpoint(backend.addr)], scale_to_zero=True))

        responder = await Responder(conn, warm_up).start()
        proxy = await make_proxy()
        await routes.serve(proxy, cold_route())
        status, _, body = await request(client, proxy.port)
        assert (status, body) == (200, "awake")
        assert len(responder.requests) == 1


async def test_queue_full_sheds_503_with_retry_after(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    proxy = await make_proxy(max_held_per_env=1)
    await routes.serve(proxy, cold_route())
    first = asyncio.create_task(request(client, proxy.port))
    await eventually(lambda: proxy.holds.held.get("e1") == 1, 5)
    status, headers, body = await request(client, proxy.port)
    assert status == 503
    assert headers["Retry-After"] == "2"
    assert body == '{"error": "activating; queue full, retry shortly"}'
    first.cancel()


async def test_deadline_504(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    proxy = await make_proxy(hold_timeout=0.2)
    await routes.serve(proxy, cold_route())
    status, headers, body = await request(client, proxy.port)
    assert (status, body) == (504, '{"error": "activation timed out"}')
    assert headers["Content-Type"].startswith("application/json")
    assert proxy.holds.held == {}


async def test_oversized_body_503(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    proxy = await make_proxy(max_held_body_bytes=1024)
    await routes.serve(proxy, cold_route())
    status, headers, body = await request(client, proxy.port, method="POST", data=b"x" * 1025)
    assert (status, body) == (503, '{"error": "request too large during cold start"}')
    assert "Retry-After" not in headers
    assert proxy.holds.activations_sent == 0


async def test_held_body_is_forwarded_once_awake(
    make_proxy: ProxyFactory, routes: Routes, conn: Connection, client
) -> None:
    backend = Backend("echo")
    async with serving(backend):

        async def warm_up() -> None:
            await routes.publish(http_route(COLD_HOST, "e1", [endpoint(backend.addr)], scale_to_zero=True))

        await Responder(conn, warm_up).start()
        proxy = await make_proxy(max_held_body_bytes=1024)
        await routes.serve(proxy, cold_route())
        async with client.post(
            f"http://127.0.0.1:{proxy.port}/echo", headers={"Host": COLD_HOST}, data=b"y" * 1024
        ) as response:
            assert (response.status, await response.read()) == (200, b"y" * 1024)


async def test_failed_activation_is_retried_while_requests_are_held(
    make_proxy: ProxyFactory, routes: Routes, conn: Connection, client
) -> None:
    proxy = await make_proxy(activate_timeout=0.2)
    await routes.serve(proxy, cold_route())
    held = asyncio.create_task(request(client, proxy.port))
    await eventually(lambda: proxy.holds.activations_sent >= 1, 5, "a first Activate with nobody answering")
    responder = await Responder(conn).start()
    await eventually(lambda: len(responder.requests) >= 1, 5, "the Activate retried and answered")
    held.cancel()


async def test_client_gone_releases_its_held_slot(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    proxy = await make_proxy()
    await routes.serve(proxy, cold_route())
    held = asyncio.create_task(request(client, proxy.port))
    await eventually(lambda: proxy.holds.held.get("e1") == 1, 5)
    held.cancel()
    await eventually(lambda: proxy.holds.held == {}, 5, "held slot released after the client left")


async def test_a_route_without_scale_to_zero_is_not_held(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    proxy = await make_proxy()
    await routes.serve(proxy, http_route(COLD_HOST, "e1"))
    status, _, body = await request(client, proxy.port)
    assert (status, body) == (502, '{"error": "no healthy endpoint"}')
    assert proxy.holds.activations_sent == 0


async def test_shutdown_rejects_held_requests(make_proxy: ProxyFactory, routes: Routes, client) -> None:
    proxy = await make_proxy()
    await routes.serve(proxy, cold_route())
    held = asyncio.create_task(request(client, proxy.port))
    await eventually(lambda: proxy.holds.held.get("e1") == 1, 5)
    await proxy.stop()
    status, _, body = await held
    assert (status, body) == (503, '{"error": "proxy shutting down"}')


async def test_a_cooled_replica_the_snapshot_still_lists_is_held_and_woken(
    make_proxy: ProxyFactory, routes: Routes, conn: Connection, client
) -> None:
    """The replica was just cooled (its process is gone) and the snapshot saying so has not arrived: the
    request meets a refused connection on the only endpoint. A scale-to-zero route is then cold in fact:
    the request is held and the env woken (it was a 502 "upstream error")."""
    cooled, woken = Backend("cooled"), Backend("woken")
    responder = await Responder(conn).start()
    proxy = await make_proxy()
    async with serving(woken):
        async with serving(cooled):
            await routes.serve(proxy, http_route(COLD_HOST, "e1", [endpoint(cooled.addr)], scale_to_zero=True))
            assert (await request(client, proxy.port))[::2] == (200, "cooled")
        held = asyncio.create_task(request(client, proxy.port))  # the cooled replica's port now refuses
        await eventually(lambda: proxy.holds.held.get("e1") == 1, 5, "the request held after the refusal")
        await eventually(lambda: len(responder.requests) == 1, 5, "the env woken")
        await routes.publish(http_route(COLD_HOST, "e1", [endpoint(woken.addr)], scale_to_zero=True))
        status, _, body = await asyncio.wait_for(held, 5)
        assert (status, body) == (200, "woken")


async def test_an_always_on_route_whose_only_endpoint_refuses_answers_502_at_once(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    gone = Backend("gone")
    proxy = await make_proxy()
    async with serving(gone):
        await routes.serve(proxy, http_route(COLD_HOST, "e1", [endpoint(gone.addr)]))
    status, _, body = await request(client, proxy.port)
    assert (status, body) == (502, '{"error": "upstream error"}')
    assert proxy.holds.activations_sent == 0


@pytest.mark.parametrize(("method", "held"), [("GET", True), ("HEAD", True), ("POST", False)])
async def test_a_request_whose_replica_dies_under_it_is_held_only_when_it_can_be_replayed(
    make_proxy: ProxyFactory, routes: Routes, conn: Connection, client, method: str, held: bool
) -> None:
    """The cooled replica accepted the request and died without answering: a GET or HEAD (no body) is sent
    again, held and answered by the woken env; a POST is not replayed (502)."""
    woken = Backend("woken")
    responder = await Responder(conn).start()
    proxy = await make_proxy()
    async with serving(woken), dying_upstream() as dying:
        await routes.serve(proxy, http_route(COLD_HOST, "e1", [endpoint(dying)], scale_to_zero=True))
        sent = asyncio.create_task(request(client, proxy.port, method=method))
        if held:
            await eventually(lambda: proxy.holds.held.get("e1") == 1, 5, "the request held after the replica died")
            await routes.publish(http_route(COLD_HOST, "e1", [endpoint(woken.addr)], scale_to_zero=True))
        status, _, body = await asyncio.wait_for(sent, 10)
    if held:
        assert status == 200 and len(responder.requests) == 1
    else:
        assert (status, body) == (502, '{"error": "upstream error"}')
