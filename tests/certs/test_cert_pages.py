"""The proxy's certificate set in pages (issue 42): 10,000 certificates through a server whose max_payload is
1 MiB (a default nats-server's; the embedded one has 8 MiB) reach a :class:`CertClient` whole, in more than
one page; a proxy from before paging is refused (not handed a first page it would take for the whole set); a
sequence cut after page 1 keeps the previous set, its cache too; a server from before paging is one page.

Every certificate is a distinct leaf of a local CA with its own P-256 key (0.2 ms each: no need to share one)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from nacl.public import PrivateKey
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.certs.localca import load_or_create
from services.secrets import certkeys
from shared import certs as C
from shared import keys as K
from shared.certclient import CACHE_FILE, CertClient, CertsUnavailable, open_bundle, open_cert_pages
from shared.certs import CHANGED_SUBJECT, KEYS_OPEN_SUBJECT
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, load_keyring, public_bytes, seal
from shared.state.feed import StateView
from shared.txn import Writer
from tests.secrets.test_service import secrets_service as running_secrets_service
from tests.waiting import eventually

COUNT = 10_000
SMALL_PAYLOAD = 1 << 20


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server of max_payload 1 MiB (always the local binary: the limit is the point)."""
    server = EmbeddedNats(data_dir=tmp_path / "nats-1mib", max_payload=SMALL_PAYLOAD).start()
    try:
        yield server.url
    finally:
        server.stop()


async def store_certificates(view: StateView, writer: Writer, ca_dir: Path, count: int) -> None:
    published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    assert isinstance(published, pb.SecretsKey)
    ca, now = load_or_create(ca_dir), time.time()
    txns = []
    for i in range(count):
        host = f"h{i:05d}.localhost"
        chain, key_pem = ca.issue(host, now)
        issued = C.Issued(chain, seal(published.public_key, key_pem), published.key_id)
        txns.append(writer.txn().create(C.after_success(C.pending_record(host, C.LOCAL_ISSUER), issued, "local")))
    assert all(r is None for r in await writer.commit_many(txns))


def responder(
    handle: Callable[[cpb.OpenCertKeysRequest, bytes], cpb.OpenCertKeysResponse | None],
) -> Callable[[Msg], Awaitable[None]]:
    """A stand-in secrets service on the real server: ``handle`` answers (None: no answer, as if stopped)."""

    async def on_request(msg: Msg) -> None:
        response = handle(cpb.OpenCertKeysRequest.FromString(msg.data), msg.data)
        if response is not None:
            await msg.respond(response.SerializeToString())

    return on_request


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_ten_thousand_certificates_in_pages_through_a_1_mib_server(
    small_nats: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    conn = await connect(small_nats, name="test-pages")
    await provision(conn.js, tombstone_ttl=900)
    assert conn.nc.max_payload == SMALL_PAYLOAD
    view = StateView(conn, name="test-pages")
    await view.start()
    cache = tmp_path / "proxy" / CACHE_FILE
    client = CertClient(cache, retry=0.05, timeout=20)
    try:
        async with running_secrets_service(small_nats, tmp_path / "cluster.key"):
            await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the cluster key")
            await store_certificates(view, Writer(conn, view), tmp_path / "ca", COUNT)
            await client.start(conn)
            await eventually(lambda: len(client.current) == COUNT, 120, "all 10,000 certificates at the proxy")
            assert client.pages > 1, "one page cannot hold 10,000 certificates at 1 MiB"
            fetched = await open_cert_pages(conn, KEYS_OPEN_SUBJECT, timeout=20)
            assert len(fetched.bundle.certs) == COUNT and fetched.pages == client.pages
            assert fetched.size / fetched.pages <= SMALL_PAYLOAD - certkeys.HEADER_ROOM
            hosts = [e.hostname for e in fetched.bundle.certs]
            assert hosts == sorted(set(hosts)), "pages are disjoint and in hostname order"
            sample = client.current["h04321.localhost"]
            assert sample.chain_pem.startswith("-----BEGIN CERTIFICATE-----") and "PRIVATE KEY" in sample.key_pem

            # A proxy from before paging (no `paged`) is refused: a first page alone would drop the rest.
            with pytest.raises(CertsUnavailable, match="does not fit one message of 1048576 bytes"):
                await open_bundle(conn, KEYS_OPEN_SUBJECT, timeout=20)
            # A requester naming an absurdly small max_bytes is told which field is wrong.
            with pytest.raises(CertsUnavailable, match="max_bytes: at least 65536"):
                await open_bundle_with(conn, max_bytes=1000)

        # The secrets service is gone; a stand-in answers page 1 (the real code, the real keyring) and then
        # refuses, or goes silent: the fetch fails and the 10,000 stay, the cache file untouched.
        keyring = load_keyring(tmp_path / "cluster.key")
        assert keyring is not None
        version, before = client.version, digest(cache)
        pages_seen: list[str] = []

        def first_page_only(
            silent: bool,
        ) -> Callable[[cpb.OpenCertKeysRequest, bytes], cpb.OpenCertKeysResponse | None]:
            def handle(request: cpb.OpenCertKeysRequest, data: bytes) -> cpb.OpenCertKeysResponse | None:
                pages_seen.append(request.after)
                if not request.after:
                    return certkeys.answer_page(data, view, keyring.by_id, conn.nc.max_payload)
                return None if silent else cpb.OpenCertKeysResponse(error="refused: the service is stopping")

            return handle

        sub = await conn.nc.subscribe(KEYS_OPEN_SUBJECT, cb=responder(first_page_only(silent=False)))
        with pytest.raises(CertsUnavailable, match="refused: the service is stopping"):
            await client.fetch()
        await sub.unsubscribe()
        assert "" in pages_seen and any(pages_seen), "page 1 was answered, page 2 asked"
        assert len(client.current) == COUNT and client.version == version and digest(cache) == before

        pages_seen.clear()
        client.timeout = 0.5  # the silent page is the one awaited; a real page takes well under that here
        sub = await conn.nc.subscribe(KEYS_OPEN_SUBJECT, cb=responder(first_page_only(silent=True)))
        with pytest.raises(CertsUnavailable, match="did not answer"):
            await client.fetch()
        await sub.unsubscribe()
        assert "" in pages_seen and any(pages_seen)
        assert len(client.current) == COUNT and client.version == version and digest(cache) == before

        # A server from before paging answers the whole set without `more`: one page, applied (it is whole);
        # the follower (asleep until the next refresh) asks on the change notice.
        three = [e for e in fetched.bundle.certs[:3]]

        def old_server(request: cpb.OpenCertKeysRequest, data: bytes) -> cpb.OpenCertKeysResponse:
            return certkeys.answer(data, lambda: cpb.CertBundle(certs=three))

        client.timeout = 20
        sub = await conn.nc.subscribe(KEYS_OPEN_SUBJECT, cb=responder(old_server))
        await conn.nc.publish(CHANGED_SUBJECT, b"")  # what the certificate service says after a change
        await eventually(lambda: sorted(client.current) == [e.hostname for e in three], 10, "the old server's set")
        await sub.unsubscribe()
        assert client.pages == 1
    finally:
        await client.stop()
        await view.stop()
        await conn.close()
    assert "PRIVATE KEY" not in caplog.text, "no key material in the logs"


async def open_bundle_with(conn: Connection, *, max_bytes: int) -> None:
    request = cpb.OpenCertKeysRequest(public_key=public_bytes(PrivateKey.generate()), paged=True, max_bytes=max_bytes)
    msg = await conn.nc.request(KEYS_OPEN_SUBJECT, request.SerializeToString(), timeout=20)
    response = cpb.OpenCertKeysResponse.FromString(msg.data)
    if response.error:
        raise CertsUnavailable(response.error)


def test_a_page_is_sized_by_computation() -> None:
    """The sealed answer's size is the plaintext's plus 48 bytes plus the field's tag and length."""
    key = PrivateKey.generate()
    for plaintext in (0, 1, 127, 128, 70_000, 1 << 20):
        sealed = seal(public_bytes(key), b"x" * plaintext)
        assert cpb.OpenCertKeysResponse(sealed=sealed).ByteSize() == certkeys.sealed_response_size(plaintext)
