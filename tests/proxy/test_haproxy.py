"""The HAProxy data plane (``--engine haproxy``) end to end: a real HAProxy per test (its own free port and
directory), driven by route snapshots on real NATS; the Python hold handler behind it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import os
import signal
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import bcrypt
import h2.connection
import h2.events
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.balancer import STICKY_COOKIE, sticky_value
from services.proxy.haproxy_ingress import HAProxyIngress, haproxy_ingress
from services.proxy.launch import haproxy_binary
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH
from shared.acmechallenge import publish_answer
from shared.connection import Connection
from shared.live import proxy_key
from shared.subjects import LIVE_BUCKET
from tests.proxy.harness import (
    HOST,
    Backend,
    Routes,
    dying_upstream,
    endpoint,
    http_route,
    keep_alive_requests,
    serving,
    settings,
)
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


async def test_many_hosts_changing_at_once_rewrite_the_map_at_run_time(
    make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession
) -> None:
    """More host entries changing than MAP_REWRITE_ABOVE (300 envs warming, then 300 aliases gone) take the
    atomic whole-map rewrite, still without a reload."""
    backend = Backend("warm")

    def env_routes(warm: bool, aliases: bool) -> list[cpb.HTTPRoute]:
        hosts = [(f"h{i}.example.com", i) for i in range(300)]
        hosts += [(f"alias{i}.example.com", i) for i in range(300)] if aliases else []
        return [http_route(host, f"e{i}", [endpoint(backend.addr, f"a{i}")] if warm else []) for host, i in hosts]

    async with serving(backend):
        ingress = await make_ingress()
        await serve(routes, ingress, *env_routes(warm=False, aliases=True))
        reloads = ingress.engine.reloads
        await serve(routes, ingress, *env_routes(warm=True, aliases=True))
        for host in ("h0", "h299", "alias150"):
            assert await get(fresh, ingress, f"{host}.example.com") == (200, "warm")
        await serve(routes, ingress, *env_routes(warm=True, aliases=False))
        assert await get(fresh, ingress, "h150.example.com") == (200, "warm")
        assert (await get(fresh, ingress, "alias150.example.com"))[0] == 404
        assert ingress.engine.reloads == reloads


async def test_an_endpoint_added_at_run_time_reuses_backend_connections(
    make_ingress: IngressFactory, routes: Routes
) -> None:
    """1,000 keep-alive requests of one client reach an endpoint added through the runtime API (as every
    replica of a deploy is) over a handful of backend connections, not one each."""
    first, added = Backend("first"), Backend("added")
    async with serving(first, added):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(first.addr, "a-first")]))
        reloads = ingress.engine.reloads
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(added.addr, "a-added")]))
        assert ingress.engine.reloads == reloads  # the endpoint came through the runtime API
        statuses = await keep_alive_requests(url(ingress), HOST, 1000)
        assert statuses == [200] * 1000
        assert added.hits == 1000
        assert len(added.peers) <= 4, f"{len(added.peers)} backend connections for 1,000 keep-alive requests"


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


async def test_forwarded_headers_and_acme_answers_on_every_request(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    """What the frontend does on every request, however cheaply it is written: the app gets
    ``X-Forwarded-For`` (the client's address last), ``-Proto`` and ``-Host`` from HAProxy (a client's own
    ``-Proto``/``-Host`` replaced), and an HTTP-01 challenge for any host (one whose backend redirects to
    HTTPS, one with no route) is answered by the Python side, before any backend's middleware."""
    backend = Backend("A")
    async with serving(backend):
        ingress = await make_ingress()
        redirected = http_route("tls.example.com", "e2", [endpoint(backend.addr)])
        redirected.middleware.redirect_https = True
        await serve(routes, ingress, http_route("plain.example.com", "e1", [endpoint(backend.addr)]), redirected)
        spoofed = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example"}
        assert await get(fresh, ingress, "plain.example.com", headers=spoofed) == (200, "A")
        seen = backend.seen[-1].headers
        assert seen.getall("X-Forwarded-For") == ["203.0.113.9", "127.0.0.1"]
        assert seen.getall("X-Forwarded-Proto") == ["http"]
        assert seen.getall("X-Forwarded-Host") == ["plain.example.com"]

        token = "tok-h32"
        challenge = f"{CHALLENGE_PATH}{token}"
        await publish_answer(conn, token, f"{token}.thumbprint")
        hits = backend.hits

        async def answered(host: str) -> bool:
            async with fresh.get(url(ingress, challenge), headers={"Host": host}, allow_redirects=False) as response:
                return (response.status, await response.text()) == (200, f"{token}.thumbprint")

        await eventually(lambda: answered("tls.example.com"), 10, "the challenge answered on a redirecting host")
        assert await answered("unrouted.example.com")
        assert backend.hits == hits  # answered by the Python side, not the app
        async with fresh.get(url(ingress, "/x"), headers={"Host": "tls.example.com"}, allow_redirects=False) as r:
            assert r.status == 308  # any other path of that host is still redirected


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


class ThrowAwayCA:
    """A certificate authority for one test, issuing leaf certificates (chain + key PEM) for a host."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(self, host: str) -> tuple[str, int]:
        """(PEM of the certificate and its key, its serial number)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
        cert = (
            self._builder(subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM).decode() + key_pem.decode(), cert.serial_number


def tls_port(ingress: HAProxyIngress) -> int:
    return int(ingress.layout.tls_bind.rpartition(":")[2])


def client_context(ca: ThrowAwayCA, alpn: list[str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca.pem)
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


async def https_get(ingress: HAProxyIngress, host: str, context: ssl.SSLContext) -> tuple[int, str, int]:
    """(status, body, serial of the certificate the server showed) over a new TLS connection with SNI."""
    reader, writer = await asyncio.open_connection("127.0.0.1", tls_port(ingress), ssl=context, server_hostname=host)
    try:
        peer = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode(), x509.load_der_x509_certificate(peer).serial_number


async def h2_get(ingress: HAProxyIngress, host: str, context: ssl.SSLContext | None) -> tuple[str, int, str]:
    """(negotiated ALPN protocol, status, body) of one HTTP/2 GET; ``context`` None: h2c with prior
    knowledge on the plain listener."""
    if context is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(ingress.layout.bind.rpartition(":")[2]))
        protocol = "h2c"
    else:
        port = tls_port(ingress)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=host)
        protocol = writer.get_extra_info("ssl_object").selected_alpn_protocol()
    connection = h2.connection.H2Connection()
    connection.initiate_connection()
    headers = [(":method", "GET"), (":path", "/"), (":authority", host), (":scheme", "https" if context else "http")]
    connection.send_headers(1, headers, end_stream=True)
    writer.write(connection.data_to_send())
    status, body = 0, b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            if not chunk:
                break
            for event in connection.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    return protocol, status, body.decode()
            writer.write(connection.data_to_send())
    finally:
        writer.close()
    return protocol, status, body.decode()


async def test_tls_with_sni_for_two_hosts_h2_and_redirect(
    make_ingress: IngressFactory, routes: Routes, tmp_path: Path, fresh: aiohttp.ClientSession
) -> None:
    ca = ThrowAwayCA()
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "a.pem").write_text((a_pem := ca.issue("a.example.com"))[0])
    (certs / "b.pem").write_text((b_pem := ca.issue("b.example.com"))[0])
    backend_a, backend_b = Backend("A"), Backend("B")
    async with serving(backend_a, backend_b):
        ingress = await make_ingress(tls_listen="127.0.0.1:0", certs_dir=certs, certs_poll_interval=0.05)
        secure = pb.Middleware(redirect_https=True)
        await serve(
            routes,
            ingress,
            http_route("a.example.com", "e1", [endpoint(backend_a.addr)]),
            http_route("b.example.com", "e2", [endpoint(backend_b.addr)], middleware=secure),
        )
        context = client_context(ca)

        async def both_served() -> bool:
            try:
                return (await https_get(ingress, "b.example.com", context))[0] == 200
            except (ssl.SSLError, OSError):
                return False

        await eventually(both_served, 10, "certificates installed")
        assert await https_get(ingress, "a.example.com", context) == (200, "A", a_pem[1])
        assert await https_get(ingress, "b.example.com", context) == (200, "B", b_pem[1])  # TLS: no redirect
        async with fresh.get(url(ingress), headers={"Host": "b.example.com"}, allow_redirects=False) as response:
            assert response.status == 308  # the same route over plain HTTP is redirected
        assert await h2_get(ingress, "a.example.com", client_context(ca, ["h2", "http/1.1"])) == ("h2", 200, "A")
        assert backend_a.seen[-1].headers["X-Forwarded-Proto"] == "https"
        assert await h2_get(ingress, "a.example.com", None) == ("h2c", 200, "A")


async def test_certificate_replaced_under_load_without_a_failed_request(
    make_ingress: IngressFactory, routes: Routes, tmp_path: Path
) -> None:
    ca = ThrowAwayCA()
    certs = tmp_path / "certs"
    certs.mkdir()
    first_pem, first_serial = ca.issue("a.example.com")
    (certs / "a.pem").write_text(first_pem)
    backend = Backend("A")
    async with serving(backend):
        ingress = await make_ingress(tls_listen="127.0.0.1:0", certs_dir=certs, certs_poll_interval=0.05)
        await serve(routes, ingress, http_route("a.example.com", "e1", [endpoint(backend.addr)]))
        context = client_context(ca)
        await eventually(lambda: "a" in ingress.engine.certificates, 10, "certificate installed")
        serials: list[int] = []
        failures: list[BaseException | int] = []
        stop = asyncio.Event()

        async def client() -> None:
            while not stop.is_set():
                try:
                    status, _, serial = await https_get(ingress, "a.example.com", context)
                except (ssl.SSLError, OSError, TimeoutError) as exc:
                    failures.append(exc)
                    continue
                if status != 200:
                    failures.append(status)
                serials.append(serial)

        clients = [asyncio.create_task(client()) for _ in range(4)]
        await eventually(lambda: len(serials) >= 10, 10, "requests under way")
        reloads = ingress.engine.reloads
        second_pem, second_serial = ca.issue("a.example.com")
        (certs / "a.pem.new").write_text(second_pem)
        os.replace(certs / "a.pem.new", certs / "a.pem")
        await eventually(lambda: second_serial in serials[-4:], 10, "the new certificate served")
        stop.set()
        await asyncio.gather(*clients)
        assert failures == []
        assert first_serial in serials
        assert ingress.engine.reloads == reloads  # replaced in place, through the runtime API


async def test_full_env_requests_queue_in_haproxy_and_count_as_held(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    """At ``max_concurrency`` the next request waits in HAProxy's queue (reported as held), then proceeds."""
    gate = asyncio.Event()
    backend = Backend("busy", gate=gate)
    async with serving(backend):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(backend.addr)], max_concurrency=1))
        first = asyncio.create_task(get(fresh, ingress))
        await eventually(lambda: backend.inflight == 1, 5, "one request at the replica")
        second = asyncio.create_task(get(fresh, ingress))
        live = await conn.js.key_value(LIVE_BUCKET)

        async def queued() -> bool:
            entry = await live.get(proxy_key("p1"))
            sample = cpb.ProxyHeartbeat.FromString(entry.value or b"").envs.get("e1")
            return bool(sample and sample.held == 1 and backend.inflight == 1)

        await eventually(queued, 10, "the second request held in HAProxy's queue")
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, second), 5) == [(200, "busy")] * 2


async def test_a_cooled_replica_haproxy_still_lists_is_held_by_python_and_woken(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    """A scale-to-zero env's replica is gone before the snapshot saying so reached HAProxy: the refused
    connection sends the request to the Python handler (the backend's backup server), which holds it and
    wakes the env (it was HAProxy's 503 "No server is available")."""
    cooled, woken = Backend("cooled"), Backend("woken")
    responder = await Responder(conn).start()
    async with serving(woken):
        ingress = await make_ingress()
        async with serving(cooled):
            await serve(routes, ingress, http_route(HOST, "e1", [endpoint(cooled.addr)], scale_to_zero=True))
            assert await get(fresh, ingress) == (200, "cooled")
        held = asyncio.create_task(get(fresh, ingress))
        await eventually(lambda: ingress.proxy.holds.held.get("e1") == 1, 5, "held by the Python handler")
        await eventually(lambda: len(responder.requests) == 1, 5, "the env woken")
        await routes.publish(http_route(HOST, "e1", [endpoint(woken.addr, "a-woken")], scale_to_zero=True))
        assert await asyncio.wait_for(held, 10) == (200, "woken")
        await eventually(lambda: ingress.version == routes.version, 5, "the warm routes in haproxy")
        assert await get(fresh, ingress) == (200, "woken")


async def test_a_warm_endpoint_added_at_run_time_serves_a_scale_to_zero_env_directly(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    """The servers of a scale-to-zero env are added with their health check at run time (no reload), and a
    request reaches them without the Python handler."""
    first, second = Backend("first"), Backend("second")
    await Responder(conn).start()
    async with serving(first, second):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(first.addr, "a1")], scale_to_zero=True))
        reloads = ingress.engine.reloads
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(second.addr, "a2")], scale_to_zero=True))
        assert ingress.engine.reloads == reloads
        for _ in range(5):
            assert await get(fresh, ingress) == (200, "second")
        assert ingress.proxy.holds.completed_holds == 0


async def test_a_get_whose_replica_dies_under_it_is_sent_again_held_and_woken(
    make_ingress: IngressFactory, routes: Routes, conn: Connection, fresh: aiohttp.ClientSession
) -> None:
    """The cooled replica accepted the GET and died without answering (HAProxy's 502 "invalid or incomplete
    response", 3 times in 404 wakes of the soak): HAProxy sends it again; the dead server's refused
    connection marks it down, the retry goes to the Python handler, which holds it and wakes the env."""
    woken = Backend("woken")
    responder = await Responder(conn).start()
    async with serving(woken), dying_upstream() as dying:
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(dying, "a-dying")], scale_to_zero=True))
        held = asyncio.create_task(get(fresh, ingress))
        await eventually(lambda: ingress.proxy.holds.held.get("e1") == 1, 10, "held by the Python handler")
        await eventually(lambda: len(responder.requests) == 1, 5, "the env woken")
        await routes.publish(http_route(HOST, "e1", [endpoint(woken.addr, "a-woken")], scale_to_zero=True))
        assert await asyncio.wait_for(held, 10) == (200, "woken")


async def test_every_endpoint_added_at_run_time_gets_requests(
    make_ingress: IngressFactory, routes: Routes, fresh: aiohttp.ClientSession
) -> None:
    """Endpoints added one after another through the runtime API (a deploy's replicas, a scale-up) all get a
    share: HAProxy 2.6 put two servers added without an id on the same places of its balancing ring, and one
    of them never got a request (found with three machines: the third replica was never reached)."""
    first, *added = (Backend(name) for name in ("first", "second", "third", "fourth"))
    async with serving(first, *added):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(first.addr, "a0")]))
        reloads = ingress.engine.reloads
        endpoints = [endpoint(first.addr, "a0")]
        for index, backend in enumerate(added, start=1):
            endpoints.append(endpoint(backend.addr, f"a{index}"))
            await serve(routes, ingress, http_route(HOST, "e1", list(endpoints)))
        assert ingress.engine.reloads == reloads  # every endpoint came through the runtime API
        answered = Counter([(await get(fresh, ingress))[1] for _ in range(400)])
        assert set(answered) == {"first", "second", "third", "fourth"}, answered
        assert min(answered.values()) >= 40, answered  # 100 each expected; a server left off the ring gets 0


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> bytes:
    """One keep-alive GET on an open connection; the response head and body as read (b"" when closed)."""
    writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")) if k.lower() == b"content-length"
    )
    return head + await reader.readexactly(length)


async def test_a_kept_alive_connection_idle_across_a_reload_gets_its_next_request_answered(
    make_ingress: IngressFactory, routes: Routes
) -> None:
    """A reload's old worker answers the next request of a client connection that was idle when it was told
    to stop (``Connection: close`` on it) instead of closing it under the client: a client that does not retry
    (most HTTP libraries for a non-idempotent request) would see the request fail."""
    backend = Backend("one")
    async with serving(backend):
        ingress = await make_ingress()
        await serve(routes, ingress, http_route(HOST, "e1", [endpoint(backend.addr, "a-1")]))
        reader, writer = await asyncio.open_connection("127.0.0.1", int(ingress.layout.bind.rpartition(":")[2]))
        try:
            assert (await _exchange(reader, writer, HOST)).endswith(b"one")
            reloads = ingress.engine.reloads
            await serve(
                routes,
                ingress,
                http_route(HOST, "e1", [endpoint(backend.addr, "a-1")]),
                http_route("other.example.com", "e2", [endpoint(backend.addr, "a-2")]),
            )
            assert ingress.engine.reloads > reloads  # a new env: a reload, this connection on the old worker
            answer = await asyncio.wait_for(_exchange(reader, writer, HOST), 10)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"one"), answer
            assert b"connection: close" in answer.lower()  # the old worker's last answer on it
        finally:
            writer.close()
