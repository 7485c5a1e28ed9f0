"""Automatic HTTPS end to end: pebble issues over HTTP-01 answered through a real HAProxy proxy process, and
that proxy's TLS listener serves the issued certificates (verified against pebble's root, SNI per host)
with the app's 200; renewals swapped in without a restart; a second proxy serving the same certificates
without a new order; a proxy restarted with NATS down serving its cached ones."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from zattera.v1 import types_pb2 as pb

from services.proxy.haproxy_ingress import servable
from services.proxy.launch import haproxy_binary
from shared import certs as C
from shared.certclient import ServedCert
from shared.clock import from_timestamp
from shared.connection import Connection
from shared.embedded import free_port
from tests.certs.conftest import PROJECT_ROOT, Rig, running_proxy
from tests.eventlog import stored_events
from tests.proxy.harness import Backend, Routes, endpoint, http_route, serving
from tests.waiting import eventually

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (make system-packages)")

HOSTS = ("one.example.com", "two.example.com")
WITH_HAPROXY = "/usr/sbin:/usr/bin:/bin"


def haproxy_args(tls_port: int) -> tuple[str, ...]:
    return ("--engine", "haproxy", "--tls-listen", f"127.0.0.1:{tls_port}")


@dataclass
class Edge:
    """The proxy process pebble validates through (its HTTP port is pebble's HTTP-01 port)."""

    http_port: int
    tls_port: int
    cache_dir: Path
    process: asyncio.subprocess.Process


@pytest.fixture
async def edge(nats_url: str, conn: Connection, proxy_port: int, tmp_path: Path) -> AsyncIterator[Edge]:
    tls_port, cache_dir = free_port(), tmp_path / "edge"
    async with running_proxy(
        nats_url, proxy_port, cache_dir, *haproxy_args(tls_port), conn=conn, path=WITH_HAPROXY
    ) as process:
        yield Edge(proxy_port, tls_port, cache_dir, process)


@pytest.fixture
def proxy_process(edge: Edge) -> int:
    """The rig's proxy is the HAProxy one."""
    return edge.http_port


async def https_get(port: int, host: str, root_pem: str) -> tuple[int, str, int]:
    """(status, body, serial of the served certificate) of ``GET /`` over TLS with SNI ``host``, trusting
    only ``root_pem``."""
    context = ssl.create_default_context(cadata=root_pem)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=host)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        response = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(), x509.load_der_x509_certificate(der).serial_number


async def serves(port: int, host: str, root_pem: str, serial: int | None = None) -> bool:
    """The app's 200 over a verified handshake for ``host`` (with the certificate ``serial``, if given)."""
    try:
        status, body, served = await https_get(port, host, root_pem)
    except (OSError, ssl.SSLError, TimeoutError):
        return False
    return (status, body) == (200, "app") and serial in (None, served)


async def test_issued_through_haproxy_served_renewed_shared_and_cached(
    rig: Rig, edge: Edge, conn: Connection, nats_url: str
) -> None:
    app = Backend("app")
    async with serving(app), aiohttp.ClientSession() as client:
        redirect = pb.Middleware(redirect_https=True)
        redirected = http_route(HOSTS[0], "env-certs", [endpoint(app.addr)], middleware=redirect)
        await Routes(conn).publish(redirected, http_route(HOSTS[1], "env-certs", [endpoint(app.addr)]))

        async def routed() -> bool:
            async with client.get(f"http://127.0.0.1:{edge.http_port}/", headers={"Host": HOSTS[1]}) as response:
                return response.status == 200

        await eventually(routed, 15, "HAProxy routes the app")

        # Issued: pebble's HTTP-01 requests reach the Python answerer through HAProxy, even for the host whose
        # route redirects plain HTTP to HTTPS.
        for host in HOSTS:
            await rig.add_domain(host)
        await rig.loop().pass_once()
        for host in HOSTS:
            assert C.state_name(rig.cert(host), rig.clock.now()) == "valid", rig.cert(host).last_error
        root = rig.pebble.root_pem()
        for host in HOSTS:
            await eventually(partial(serves, edge.tls_port, host, root), 15, f"HTTPS for {host}")
        url = f"http://127.0.0.1:{edge.http_port}/"
        async with client.get(url, headers={"Host": HOSTS[0]}, allow_redirects=False) as response:
            assert (response.status, response.headers["Location"]) == (308, f"https://{HOSTS[0]}/")
        serials = {host: (await https_get(edge.tls_port, host, root))[2] for host in HOSTS}

        # A second proxy serves the very same certificates: no new order.
        second_tls = free_port()
        second = running_proxy(
            nats_url, free_port(), edge.cache_dir.parent / "second", *haproxy_args(second_tls),
            conn=conn, proxy_id="certs-test-2", path=WITH_HAPROXY,
        )  # fmt: skip
        async with second:

            async def same_certificates() -> bool:
                try:
                    served = {h: (await https_get(second_tls, h, root))[2] for h in HOSTS}
                except (OSError, ssl.SSLError, TimeoutError):
                    return False
                return served == serials

            await eventually(same_certificates, 15, "the second proxy serves the same certificates")
        issued = [e for e in await stored_events(conn) if e.kind == "certificate.issued"]
        assert len(issued) == len(HOSTS) and all(rig.cert(h).renewals == 0 for h in HOSTS)

        # Renewed (fake clock): swapped in by the running proxy, no restart.
        rig.clock.set(from_timestamp(rig.cert(HOSTS[0]).renew_at) + 1)
        await rig.loop().pass_once()
        assert rig.cert(HOSTS[0]).renewals == 1
        stored = {h: x509.load_pem_x509_certificates(rig.cert(h).chain_pem.encode())[0].serial_number for h in HOSTS}
        renewed = stored[HOSTS[0]]  # (the other may have fallen due as well: jitter)
        assert renewed != serials[HOSTS[0]]
        for host in HOSTS:
            await eventually(partial(serves, edge.tls_port, host, root, stored[host]), 15, f"{host}'s newest served")
        assert edge.process.returncode is None

        # Restarted with NATS down (and HAProxy's own certificate files gone): the client's cache is served,
        # the routes from the route cache.
        edge.process.terminate()
        await edge.process.wait()
        shutil.rmtree(edge.cache_dir / "haproxy" / "certs")
        offline_tls, dead_nats = free_port(), f"nats://127.0.0.1:{free_port()}"
        offline = running_proxy(dead_nats, free_port(), edge.cache_dir, *haproxy_args(offline_tls), path=WITH_HAPROXY)
        async with offline:
            for host in HOSTS:
                await eventually(partial(serves, offline_tls, host, root, stored[host]), 15, f"{host}'s cache")


async def test_the_python_engine_says_tls_needs_haproxy(nats_url: str, tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    with log.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.proxy", "--nats", nats_url, "--engine", "python",
            "--listen", f"127.0.0.1:{free_port()}", "--tls-listen", "127.0.0.1:0", "--cache-dir", str(tmp_path / "c"),
            cwd=PROJECT_ROOT, env={"PATH": "/usr/bin:/bin"}, stdout=sink, stderr=sink,
        )  # fmt: skip
        try:
            await eventually(lambda: "listening on" in log.read_text(), 15, "the proxy serves HTTP")
            assert "no TLS listener on 127.0.0.1:0: TLS needs the haproxy engine (HTTP only)" in log.read_text()
        finally:
            process.terminate()
            await process.wait()


def test_only_unexpired_certificates_are_handed_to_haproxy() -> None:
    fresh, stale = ServedCert("a.example.com", "CHAIN\n", "KEY\n", 200.0), ServedCert("b.example.com", "C", "K", 100.0)
    assert servable({fresh.hostname: fresh, stale.hostname: stale}, now=150.0) == {"a.example.com": "CHAIN\nKEY\n"}
