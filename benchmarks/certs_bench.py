"""Certificates benchmark: how long a new domain waits for its certificate, and what certificates cost a proxy.

``python -m benchmarks.certs_bench [--full]``. Against a real nats-server, Debian's ``pebble`` ACME server on
loopback (``PEBBLE_VA_NOSLEEP=1``), the secrets service and a real proxy in-process (it answers HTTP-01; the
HAProxy engine with a TLS listener when haproxy is installed), and the certificate loop under its lease with
the real clock:

* ``domains add`` → certificate stored: the ``Domain`` write (what the command does) until the view shows
  the ``Certificate`` VALID — account (first only), order, HTTP-01 through the proxy, finalize, seal, fenced
  write; → delivered: until the proxy's ``CertClient`` holds it; → served: until ``GET /`` over the proxy's
  HAProxy TLS listener (SNI, pebble's root trusted) answers the app's 200 (5 domains quick, 20 full). The
  ``acme`` library polls an authorization once a second, which bounds the figure from below;
* memory of 1,000 certificates (5,000 full) held by a proxy's ``CertClient`` (tracemalloc of the set it
  keeps, P-256 keys and a one-certificate chain each), and the time of one fetch of them all;
* a proxy's fetch of 10,000 certificates (issue 42, both modes): pages, bytes and time, in pages of the
  embedded server's 8 MiB and of a default nats-server's 1 MiB (``max_bytes``).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import tracemalloc
from functools import partial
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, percentile, row
from services.certs.issuer import AcmeIssuer
from services.certs.localca import load_or_create
from services.certs.loop import CertificateLoop
from services.proxy.haproxy_ingress import HAProxyIngress, haproxy_ingress
from services.proxy.launch import haproxy_binary
from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared import certs as C
from shared import keys as K
from shared.certclient import CACHE_FILE, CertClient, open_bundle, open_cert_pages
from shared.certs import KEYS_OPEN_SUBJECT
from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.embedded import free_port
from shared.ids import new_id
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, seal
from shared.state.feed import StateView
from shared.txn import Writer
from tests.certs.pebble import running_pebble
from tests.certs.test_https import serves
from tests.proxy.harness import Backend, Routes, endpoint, http_route, serving
from tests.secrets.test_service import secrets_service
from tests.waiting import eventually


async def _issuance(conn: Connection, view: StateView, writer: Writer, tmp: Path, url: str, domains: int) -> list[Row]:
    port = free_port()
    hosts = [f"bench-{i}.example.com" for i in range(domains)]
    app = Backend("app")
    with running_pebble(tmp / "pebble", port) as pebble:
        cfg = ProxySettings(host="127.0.0.1", port=port, proxy_id="bench", tls_listen="127.0.0.1:0")
        ingress: Proxy | HAProxyIngress
        if haproxy_binary() is not None:
            ingress = haproxy_ingress(cfg, nats_url=url, cache_dir=tmp / "p")
        else:  # HTTP-01 answered, no TLS listener: the HTTPS row is left out
            ingress = Proxy(cfg, nats_url=url, cache_dir=tmp / "p")
        await ingress.start()
        proxy = ingress.proxy if isinstance(ingress, HAProxyIngress) else ingress
        await proxy.wait_connected()
        acme = AcmeIssuer(pebble.directory_url, "bench@example.com", ca_bundle=str(pebble.ca_bundle))
        loop = CertificateLoop(LoopDeps(conn, view, RealClock(), coalesce=0.001), acme=acme)
        leading = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="bench"))
        client = CertClient(tmp / "client" / CACHE_FILE)
        await client.start(conn)
        stored, delivered, served = [], [], []
        try:
            async with serving(app):
                version = await Routes(conn).publish(*(http_route(h, "E1", [endpoint(app.addr)]) for h in hosts))
                await eventually(lambda: proxy.table.version == version, 10, "the routes")
                root = pebble.root_pem()
                for host in hosts:
                    domain = pb.Domain(hostname=host, environment_id="E1", project_id="P1")
                    domain.meta.id = new_id()
                    started = time.perf_counter()
                    await writer.commit(writer.txn().create(domain))

                    def valid(h: str = host) -> bool:
                        cert = view.get(K.CERT, K.cert_id(h))
                        return isinstance(cert, pb.Certificate) and cert.state == C.VALID

                    await eventually(valid, 60, f"certificate for {host}")
                    stored.append((time.perf_counter() - started) * 1000)
                    await eventually(partial(holds, client, host), 30, f"{host} delivered")
                    delivered.append((time.perf_counter() - started) * 1000)
                    if isinstance(ingress, HAProxyIngress):
                        tls_port = int(ingress.layout.tls_bind.rpartition(":")[2])
                        await eventually(partial(serves, tls_port, host, root), 30, f"HTTPS for {host}")
                        served.append((time.perf_counter() - started) * 1000)
        finally:
            await client.stop()
            leading.cancel()
            await asyncio.gather(leading, return_exceptions=True)
            await ingress.stop()
    anchor = f"{domains} domains, pebble on loopback; the acme library polls once a second"
    rows = [
        row("certs: domains add → certificate stored (p50)", percentile(stored, 50), "ms", "", anchor),
        row("certs: domains add → certificate stored (max)", max(stored), "ms", "", "the first also registers"),
        row("certs: domains add → certificate at the proxy (p50)", percentile(delivered, 50), "ms", "≤ 10 s", ""),
    ]
    if served:
        rows.append(
            row(
                "certs: domains add → first HTTPS 200 through the proxy (p50)",
                percentile(served, 50),
                "ms",
                "≤ 10 s",
                "HAProxy TLS listener, pebble's root, SNI",
            )
        )
    return rows


def holds(client: CertClient, host: str) -> bool:
    return host in client.current


async def _footprint(conn: Connection, view: StateView, writer: Writer, tmp: Path, count: int) -> list[Row]:
    published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    assert isinstance(published, pb.SecretsKey)
    ca = load_or_create(tmp / "ca")
    now = time.time()
    txns = []
    for i in range(count):
        host = f"mem-{i}.localhost"
        chain, key_pem = ca.issue(host, now)
        sealed = C.Issued(chain, seal(published.public_key, key_pem), published.key_id)
        txns.append(writer.txn().create(C.after_success(C.pending_record(host, C.LOCAL_ISSUER), sealed, "local")))
    assert all(r is None for r in await writer.commit_many(txns))
    client = CertClient(tmp / "mem" / CACHE_FILE)
    client._conn = conn  # one fetch, measured on its own (no follower task)
    started = time.perf_counter()
    await open_bundle(conn, KEYS_OPEN_SUBJECT, timeout=60)
    fetch_ms = (time.perf_counter() - started) * 1000
    tracemalloc.start()
    try:
        await client.fetch()
        held = len(client.current)
        current, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held >= count
    per_thousand = current / held * 1000 / 1e6
    return [
        row("certs: proxy memory per 1,000 certificates", per_thousand, "MB", "≤ 10 MB", f"{held:,} held (P-256)"),
        row(f"certs: one request for {held:,} certificates", fetch_ms, "ms", "", "opened, re-sealed, answered, opened"),
    ]


PAGED = 10_000


async def _paged(conn: Connection, view: StateView, writer: Writer, tmp: Path, total: int) -> list[Row]:
    """Certificates added up to ``total``; one proxy fetch of them all, in 8 MiB then 1 MiB pages."""
    published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    assert isinstance(published, pb.SecretsKey)
    ca, now = load_or_create(tmp / "ca"), time.time()
    txns = []
    for i in range(total - len(view.all(K.CERT))):
        host = f"page-{i}.localhost"
        chain, key_pem = ca.issue(host, now)
        sealed = C.Issued(chain, seal(published.public_key, key_pem), published.key_id)
        txns.append(writer.txn().create(C.after_success(C.pending_record(host, C.LOCAL_ISSUER), sealed, "local")))
    assert all(r is None for r in await writer.commit_many(txns))
    rows = []
    for label, max_bytes in (("8 MiB", 0), ("1 MiB", 1 << 20)):

        async def whole(limit: int = max_bytes) -> bool:
            return (
                len((await open_cert_pages(conn, KEYS_OPEN_SUBJECT, timeout=60, max_bytes=limit)).bundle.certs) >= total
            )

        await eventually(whole, 60, "the secrets service sees every certificate")
        started = time.perf_counter()
        fetched = await open_cert_pages(conn, KEYS_OPEN_SUBJECT, timeout=60, max_bytes=max_bytes)
        ms = (time.perf_counter() - started) * 1000
        n = len(fetched.bundle.certs)
        note = f"{fetched.pages} pages, {fetched.size / 1e6:.1f} MB, P-256"
        rows.append(row(f"certs: a proxy gets {n:,} certificates ({label} pages)", ms, "ms", "", note))
    return rows


async def _bench(url: str, tmp: Path, domains: int, certificates: int) -> list[Row]:
    conn = await connect(url, name="bench")
    await provision(conn.js)
    view = StateView(conn, name="bench")
    await view.start()
    writer = Writer(conn, view)
    try:
        async with secrets_service(url, tmp / "cluster.key"):
            await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the cluster key")
            rows = await _issuance(conn, view, writer, tmp, url, domains)
            rows += await _footprint(conn, view, writer, tmp, certificates)
            rows += await _paged(conn, view, writer, tmp, PAGED)
    finally:
        await view.stop()
        await conn.close()
    return rows


def run(quick: bool = True) -> list[Row]:
    domains, certificates = (5, 1_000) if quick else (20, 5_000)
    with embedded_server("zattera-certs-bench-") as server, tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_bench(server.url, Path(tmp), domains, certificates))


if __name__ == "__main__":
    bench_main("Certificates", run, __doc__, "20 domains, 5,000 certificates")
