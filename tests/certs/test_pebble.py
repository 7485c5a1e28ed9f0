"""The certificate loop against a real ACME server (pebble) on loopback, HTTP-01 answered by a real proxy.

The served chain is checked with ``ssl`` (a TLS handshake on loopback with the distributed chain and key,
verified against pebble's root): TLS termination in the proxies is the ingress data plane's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import stat
from collections.abc import Mapping
from pathlib import Path

import pytest
from cryptography import x509

from shared import certs as C
from shared import keys as K
from shared.certclient import CACHE_FILE, CertClient, ServedCert, bundle_certs, open_bundle
from shared.certs import KEYS_OPEN_SUBJECT
from shared.clock import from_timestamp
from shared.embedded import free_port
from tests.certs.conftest import Rig
from tests.eventlog import stored_events, wait_for_kinds
from tests.waiting import eventually

HOSTS = ("one.example.com", "two.example.com")


async def handshake(served: ServedCert, root_pem: str, tmp_path: Path) -> x509.Certificate:
    """A TLS handshake on loopback: a server with ``served``, a client trusting only ``root_pem``."""
    pem = tmp_path / f"{served.hostname}.pem"
    pem.write_text(served.pem)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(pem)
    client_context = ssl.create_default_context(cadata=root_pem)
    port = free_port()
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port, ssl=server_context)
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context, server_hostname=served.hostname
        )
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return x509.load_der_x509_certificate(der)
    finally:
        server.close()
        await server.wait_closed()


async def test_issue_renew_distribute_and_survive_a_ca_outage(rig: Rig, tmp_path: Path) -> None:
    for host in HOSTS:
        await rig.add_domain(host)
    loop = rig.loop()
    await loop.pass_once()

    for host in HOSTS:
        cert = rig.cert(host)
        assert C.state_name(cert, rig.clock.now()) == "valid", cert.last_error
        assert b"PRIVATE KEY" not in cert.sealed_key and cert.key_id
    earliest = min(from_timestamp(rig.cert(h).renew_at) for h in HOSTS)
    await loop.pass_once()  # what the records' change wakes it for: nothing due, a wake-up planned
    assert loop.seconds_until_due() == pytest.approx(earliest - rig.clock.now())  # the loop wakes then
    events = await wait_for_kinds(rig.conn, "certificate.issued")
    assert {e.fields["hostname"] for e in events if e.kind == "certificate.issued"} == set(HOSTS)

    # Distribution: the proxy's client gets both, with keys, and the chain validates against pebble's root.
    client = CertClient(tmp_path / "proxy" / CACHE_FILE, retry=0.05)
    await client.start(rig.conn)
    try:
        await eventually(lambda: set(client.current) == set(HOSTS), 10, "both certificates distributed")
        root = rig.pebble.root_pem()
        for host in HOSTS:
            peer = await handshake(client.current[host], root, tmp_path)
            assert host in peer.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value.get_values_for_type(x509.DNSName)
        assert stat.S_IMODE((tmp_path / "proxy" / CACHE_FILE).stat().st_mode) == 0o600
        first = client.current[HOSTS[0]]

        # A second proxy serves the very same certificates: no new order.
        second = CertClient(tmp_path / "proxy-2" / CACHE_FILE)
        await second.start(rig.conn)
        try:
            await eventually(lambda: dict(second.current) == dict(client.current), 10, "the second proxy's set")
        finally:
            await second.stop()
        issued = [e for e in await stored_events(rig.conn) if e.kind == "certificate.issued"]
        assert len(issued) == len(HOSTS) and all(rig.cert(h).renewals == 0 for h in HOSTS)

        # Renewal, driven by the fake clock: due at 2/3 of the lifetime (less jitter).
        rig.clock.set(from_timestamp(rig.cert(HOSTS[0]).renew_at) + 1)
        assert C.state_name(rig.cert(HOSTS[0]), rig.clock.now()) == "renewing"
        # A new leader renews: it has the stored account's key opened by the secrets service (no new account).
        account_before = rig.view.get(K.ACME_ACCOUNT, C.ACCOUNT_NAME)
        await rig.loop().pass_once()
        assert rig.view.get(K.ACME_ACCOUNT, C.ACCOUNT_NAME) == account_before
        renewed = rig.cert(HOSTS[0])
        assert renewed.renewals == 1 and renewed.state == C.VALID
        await wait_for_kinds(rig.conn, "certificate.renewed")

        def changed(current: Mapping[str, ServedCert]) -> bool:
            return current[HOSTS[0]].chain_pem != first.chain_pem

        await eventually(lambda: changed(client.current), 10, "the renewed certificate reaches the proxy")
        await handshake(client.current[HOSTS[0]], root, tmp_path)
    finally:
        await client.stop()

    # CA outage: the renewal fails, the old certificate stays stored and served, the next order backs off.
    served = rig.cert(HOSTS[1])
    down = rig.loop(f"https://127.0.0.1:{free_port()}/dir")
    rig.clock.set(from_timestamp(served.renew_at) + 1)
    await down.pass_once()
    failed = rig.cert(HOSTS[1])
    assert failed.state == C.RENEWING and failed.chain_pem == served.chain_pem
    assert "unreachable" in failed.last_error and failed.failures == 1
    assert from_timestamp(failed.retry_at) == rig.clock.now() + C.BACKOFF_BASE
    assert C.plan(HOSTS, {h: rig.cert(h) for h in HOSTS}, rig.clock.now()).orders == ()
    await wait_for_kinds(rig.conn, "certificate.failed")
    still = bundle_certs(await open_bundle(rig.conn, KEYS_OPEN_SUBJECT))
    assert still[HOSTS[1]].chain_pem == served.chain_pem  # proxies keep getting the old one

    # A proxy starting while the control plane is down serves its cache.
    offline = CertClient(tmp_path / "proxy" / CACHE_FILE)
    assert set(offline.current) == set(HOSTS) and offline.current[HOSTS[0]].key_pem


async def test_a_failed_challenge_is_reported_with_the_cas_error(rig: Rig) -> None:
    host = "unreachable.example.com"
    rig.pebble.resolve(host, "127.0.0.2")  # nothing answers HTTP-01 there: the proxy listens on 127.0.0.1
    await rig.add_domain(host)
    await rig.loop().pass_once()
    cert = rig.cert(host)
    assert cert.state == C.FAILED and cert.failures == 1
    assert cert.last_error.startswith(f"{host}: connection:"), cert.last_error
    events = await wait_for_kinds(rig.conn, "certificate.failed")
    assert host in events[-1].message and events[-1].environment_id == "env-certs"
