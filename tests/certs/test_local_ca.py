"""Out of the box: the certificate service process makes a local CA once and issues ``*.localhost``
certificates from it; a proxy's client receives them and they validate against ``local-ca.pem``."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.secrets.service import SecretsService
from shared import certs as C
from shared import keys as K
from shared import localca
from shared.backup.cluster import write_state
from shared.certclient import CACHE_FILE, CertClient
from shared.connection import Connection
from shared.routewire import content_digest, encode_messages
from shared.state.feed import StateView
from shared.subjects import ROUTES_SNAPSHOT_SUBJECT
from shared.txn import Writer
from tests.certs.conftest import PROJECT_ROOT
from tests.certs.test_pebble import handshake
from tests.eventlog import stored_events, wait_for_kinds
from tests.waiting import eventually

HOST = "hello-production.localhost"
OTHER, THIRD = "other-production.localhost", "third-production.localhost"


async def start_certs_service(nats_url: str, data_dir: Path, **env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.certs",
        "--nats",
        nats_url,
        cwd=PROJECT_ROOT,
        env={
            **os.environ,
            "ZATTERA_DATA_DIR": str(data_dir),
            "ZATTERA_LEASE_TTL": "1",
            "ZATTERA_LEASE_RENEW": "0.3",
            **env,
        },
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        await asyncio.wait_for(process.wait(), 20)


async def test_the_service_issues_localhost_certificates_from_a_ca_it_makes_once(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, secrets_service: SecretsService, tmp_path: Path
) -> None:
    domain = pb.Domain(hostname=HOST, environment_id="env-local", project_id="p")
    domain.meta.id = "d1"
    await writer.commit(writer.txn().create(domain))
    data_dir = tmp_path / "control"
    # Two replicas sharing the data dir: one CA between them, one order (the lease), also across the handover.
    replicas = [await start_certs_service(nats_url, data_dir) for _ in range(2)]
    try:

        def issued() -> bool:
            cert = view.get(K.CERT, K.cert_id(HOST))
            return isinstance(cert, pb.Certificate) and cert.state == C.VALID

        await eventually(issued, 30, "a local certificate")
        await wait_for_kinds(conn, "certificate.issued")
    finally:
        for process in replicas:
            await stop(process)
    assert [e.fields["hostname"] for e in await stored_events(conn) if e.kind == "certificate.issued"] == [HOST]
    ca_pem = (data_dir / "certs" / "local-ca.pem").read_text()
    assert stat.S_IMODE((data_dir / "certs" / "local-ca.key").stat().st_mode) == 0o600
    cert = view.get(K.CERT, K.cert_id(HOST))
    assert isinstance(cert, pb.Certificate) and cert.issuer == C.LOCAL_ISSUER

    # Rotating the cluster secrets key re-seals certificate keys too: proxies still get them.
    rotated = await secrets_service.rotate()
    assert rotated.resealed == 1 and not rotated.error

    def resealed() -> bool:
        again = view.get(K.CERT, K.cert_id(HOST))
        return isinstance(again, pb.Certificate) and again.key_id == rotated.key_id

    await eventually(resealed, 10, "the certificate key re-sealed")

    client = CertClient(tmp_path / "proxy" / CACHE_FILE)
    await client.start(conn)
    try:
        await eventually(lambda: HOST in client.current, 10, "the certificate reaches the proxy")
        await handshake(client.current[HOST], ca_pem, tmp_path)
    finally:
        await client.stop()

    again = await start_certs_service(nats_url, data_dir)  # a restart keeps the CA it made
    await stop(again)
    assert (data_dir / "certs" / "local-ca.pem").read_text() == ca_pem


async def publish_cert_hosts(conn: Connection, version: int, *hostnames: str) -> None:
    """A route snapshot that routes ``hostnames`` (as the routes service names them in ``cert_hosts``)."""
    data = cpb.RouteSnapshot(version=version, cert_hosts=sorted(hostnames)).SerializeToString(deterministic=True)
    for message in encode_messages(data, version=version, digest=content_digest(data), max_message_bytes=1 << 20):
        await conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
    await conn.nc.flush()


def issued_by(chain_pem: str, ca_pem: str) -> bool:
    try:
        x509.load_pem_x509_certificate(chain_pem.encode()).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_pem.encode())
        )
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def valid(view: StateView, hostname: str) -> bool:
    cert = view.get(K.CERT, K.cert_id(hostname))
    return isinstance(cert, pb.Certificate) and cert.state == C.VALID


async def test_a_name_gets_its_certificate_as_soon_as_it_is_routed(
    nats_url: str, conn: Connection, view: StateView, secrets_service: SecretsService, tmp_path: Path
) -> None:
    """An implicit ``<app>-<env>.localhost`` name has no Domain record: only the route snapshot names it. Its
    certificate used to wait for the loop's tick (15 s; an hour here): the snapshot now wakes the loop."""
    service = await start_certs_service(nats_url, tmp_path / "control", ZATTERA_LOOP_TICK="3600")
    try:
        await eventually(lambda: view.lease("certs") is not None, 30, "the certs loop leading")
        await publish_cert_hosts(conn, 1, HOST)
        await eventually(lambda: valid(view, HOST), 20, "the routed name's certificate, long before the tick")
        await publish_cert_hosts(conn, 2, HOST, "other-production.localhost")
        await eventually(lambda: valid(view, "other-production.localhost"), 20, "a second routed name's")
    finally:
        await stop(service)


async def test_more_new_names_than_one_write_holds_all_get_their_record(
    nats_url: str, conn: Connection, view: StateView, secrets_service: SecretsService, tmp_path: Path
) -> None:
    """10,000 envs applied at once: one pass finds thousands of new names. Their PENDING records went in one
    write, over the batch limit (1,000), and the pass failed, every time: no name got a certificate."""
    service = await start_certs_service(nats_url, tmp_path / "control", ZATTERA_LOOP_TICK="3600")
    names = [f"e{i}-production.localhost" for i in range(1_200)]
    try:
        await eventually(lambda: view.lease("certs") is not None, 30, "the certs loop leading")
        await publish_cert_hosts(conn, 1, *names)
        await eventually(lambda: len(view.all(K.CERT)) >= len(names), 30, "a record for every routed name")
        await eventually(lambda: valid(view, names[0]), 30, "the first of them issued")
    finally:
        await stop(service)


async def test_a_set_that_arrives_while_the_reader_installs_the_previous_one_is_handed_out_next(
    nats_url: str, conn: Connection, writer: Writer, view: StateView, secrets_service: SecretsService, tmp_path: Path
) -> None:
    """A proxy's reader of certificate sets is busy with one (HAProxy starting on a busy machine) when the next
    arrives: it must get that one as soon as it asks, not at the next change (the local-CA certificate of a
    ``*.localhost`` name was once served with the self-signed fallback for over a minute)."""
    service = await start_certs_service(nats_url, tmp_path / "control")
    client = CertClient(tmp_path / "proxy" / CACHE_FILE)
    await client.start(conn)
    try:
        updates = client.updates()
        assert dict(await anext(updates)) == {}  # the reader now installs this (empty) set, slowly
        domain = pb.Domain(hostname=HOST, environment_id="env-local", project_id="p")
        domain.meta.id = "d1"
        await writer.commit(writer.txn().create(domain))
        await eventually(lambda: client.version == 1, 30, "the issued set fetched and announced meanwhile")
        newest = await asyncio.wait_for(anext(updates), 5)  # it was a wait for the next change (5 min refresh)
        assert HOST in newest
    finally:
        await client.stop()
        await stop(service)


async def test_a_restored_certificate_reaches_the_proxies_and_is_kept_until_its_name_is_routed(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, secrets_service: SecretsService, tmp_path: Path
) -> None:
    """As ``zattera restore`` does on a new machine: a certificate record put back by another writer than the
    loop, before anything routes its name (the environments come last), under a certs service with another
    local CA. The proxies are told at once (not at their 5-minute refresh), the record is not forgotten
    as unwanted, and once the name is routed it is served as it was: no new order. The restore puts the old
    machine's CA in the new one's certs directory first: the running service issues from it from then on."""
    first = await start_certs_service(nats_url, tmp_path / "old", ZATTERA_LOOP_TICK="3600")
    try:
        await eventually(lambda: view.lease("certs") is not None, 30, "the certs loop leading")
        await publish_cert_hosts(conn, 1, HOST)
        await eventually(lambda: valid(view, HOST), 20, "the certificate of the old machine")
    finally:
        await stop(first)
    backed_up = view.get(K.CERT, K.cert_id(HOST))
    assert isinstance(backed_up, pb.Certificate)
    await writer.commit(writer.txn().delete(K.cert(HOST)))

    client = CertClient(tmp_path / "proxy" / CACHE_FILE)
    await client.start(conn)
    service = await start_certs_service(nats_url, tmp_path / "new", ZATTERA_LOOP_TICK="3600")
    try:
        await eventually(lambda: view.lease("certs") is not None, 30, "the new certs loop leading")
        await publish_cert_hosts(conn, 1, OTHER)
        await eventually(lambda: OTHER in client.current, 20, "the proxy holds the new machine's certificate")
        assert HOST not in client.current
        old_ca = (tmp_path / "old" / "certs" / localca.CA_KEY_FILE).read_bytes()
        localca.install(tmp_path / "new" / "certs", old_ca)  # the restore's CA, then its state write
        await write_state(conn, [(K.cert(HOST), backed_up.SerializeToString())])
        await eventually(lambda: HOST in client.current, 10, "the restored certificate reaches the proxy")
        assert client.current[HOST].chain_pem == backed_up.chain_pem

        await publish_cert_hosts(conn, 2, HOST, OTHER, THIRD)
        await eventually(lambda: valid(view, THIRD), 20, "a pass after the restored name is routed")
        kept = view.get(K.CERT, K.cert_id(HOST))
        assert isinstance(kept, pb.Certificate) and kept.chain_pem == backed_up.chain_pem
        old_ca_pem = (tmp_path / "old" / "certs" / localca.CA_CERT_FILE).read_text()
        assert (tmp_path / "new" / "certs" / localca.CA_CERT_FILE).read_text() == old_ca_pem
        third = view.get(K.CERT, K.cert_id(THIRD))
        assert isinstance(third, pb.Certificate) and issued_by(third.chain_pem, old_ca_pem), "no restart needed"
        other = view.get(K.CERT, K.cert_id(OTHER))
        assert isinstance(other, pb.Certificate) and not issued_by(other.chain_pem, old_ca_pem)
    finally:
        await stop(service)
        await client.stop()
