"""Certificates benchmark: how long a new domain waits for its certificate, and what certificates cost a proxy.

``python -m benchmarks.certs_bench [--full]``. Against a real nats-server, Debian's ``pebble`` ACME server on
loopback (``PEBBLE_VA_NOSLEEP=1``), the secrets service and a real proxy in-process (it answers HTTP-01),
and the certificate loop under its lease with the real clock:

* ``domains add`` → certificate stored: the ``Domain`` write (what the command does) until the view shows
  the ``Certificate`` VALID — account (first only), order, HTTP-01 through the proxy, finalize, seal, fenced
  write; and → delivered: until the proxy's ``CertClient`` holds it (5 domains quick, 20 full). The
  ``acme`` library polls an authorization once a second, which bounds the figure from below;
* memory of 1,000 certificates (5,000 full) held by a proxy's ``CertClient`` (tracemalloc of the set it
  keeps, P-256 keys and a one-certificate chain each), and the time of one fetch of them all.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import tracemalloc
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, percentile, row
from services.certs.issuer import AcmeIssuer
from services.certs.localca import load_or_create
from services.certs.loop import CertificateLoop
from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared import certs as C
from shared import keys as K
from shared.certclient import CACHE_FILE, CertClient, open_bundle
from shared.certs import KEYS_OPEN_SUBJECT
from shared.clock import RealClock
from shared.embedded import free_port
from shared.ids import new_id
from shared.lease import run_while_leading
from shared.natsio import Connection, connect, provision
from shared.secrets import CLUSTER_KEY, seal
from shared.txn import Writer
from shared.view import StateView
from tests.certs.pebble import running_pebble
from tests.secrets.test_service import secrets_service
from tests.waiting import eventually


async def _issuance(conn: Connection, view: StateView, writer: Writer, tmp: Path, url: str, domains: int) -> list[Row]:
    port = free_port()
    with running_pebble(tmp / "pebble", port) as pebble:
        proxy = Proxy(ProxySettings(host="127.0.0.1", port=port, proxy_id="bench"), nats_url=url, cache_dir=tmp / "p")
        await proxy.start()
        await proxy.wait_connected()
        acme = AcmeIssuer(pebble.directory_url, "bench@example.com", ca_bundle=str(pebble.ca_bundle))
        loop = CertificateLoop(conn=conn, view=view, clock=RealClock(), acme=acme, coalesce=0.001)
        leading = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="bench"))
        client = CertClient(tmp / "client" / CACHE_FILE)
        await client.start(conn)
        stored, delivered = [], []
        try:
            for i in range(domains):
                host = f"bench-{i}.example.com"
                domain = pb.Domain(hostname=host, environment_id="E1", project_id="P1")
                domain.meta.id = new_id()
                started = time.perf_counter()
                await writer.commit(writer.txn().create(domain))

                def valid(h: str = host) -> bool:
                    cert = view.get(K.CERT, K.cert_id(h))
                    return isinstance(cert, pb.Certificate) and cert.state == C.VALID

                await eventually(valid, 60, f"certificate for {host}")
                stored.append((time.perf_counter() - started) * 1000)
                await eventually(lambda h=host: h in client.current, 30, f"{host} delivered")  # type: ignore[misc]
                delivered.append((time.perf_counter() - started) * 1000)
        finally:
            await client.stop()
            leading.cancel()
            await asyncio.gather(leading, return_exceptions=True)
            await proxy.stop()
    anchor = f"{domains} domains, pebble on loopback; the acme library polls once a second"
    return [
        row("certs: domains add → certificate stored (p50)", percentile(stored, 50), "ms", "", anchor),
        row("certs: domains add → certificate stored (max)", max(stored), "ms", "", "the first also registers"),
        row("certs: domains add → certificate at the proxy (p50)", percentile(delivered, 50), "ms", "≤ 10 s", ""),
    ]


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
    finally:
        await view.stop()
        await conn.close()
    return rows


def run(quick: bool = True) -> list[Row]:
    domains, certificates = (5, 1_000) if quick else (20, 5_000)  # a set must fit one message (8 MiB)
    with embedded_server("zattera-certs-bench-") as server, tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_bench(server.url, Path(tmp), domains, certificates))


if __name__ == "__main__":
    bench_main("Certificates", run, __doc__, "20 domains, 5,000 certificates")
