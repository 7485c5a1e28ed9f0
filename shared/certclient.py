"""The proxy side of certificates: the current (hostname, chain, private key) set and its updates.

:class:`CertClient` loads its 0600 cache file before any network activity (a proxy that starts while the
control plane is down serves its cached certificates), then asks the secrets service for every servable
certificate on ``zattera.certs.keys.open`` with a fresh X25519 key kept in memory only (the answer is
sealed to it), again on every ``zattera.certs.changed`` notice and every ``refresh`` seconds. Each new set
is written to the cache atomically (0600 from creation) and handed to :meth:`updates` readers.

The set comes in pages (:func:`open_cert_pages`: one NATS message holds at most ``max_payload`` bytes, about
8,000 certificates at 8 MiB): every page is sealed to the same key, made for this one fetch, and the set
replaces the current one only once the last page is in; any failure on the way keeps the current set whole.
docs/certificates.md shows how a TLS engine (HAProxy's ``set ssl cert``, Python ``ssl``) consumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from nats.aio.subscription import Subscription
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.certs import CHANGED_SUBJECT, KEYS_OPEN_SUBJECT
from shared.clock import from_timestamp
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.files import write_private_json
from shared.secrets import public_bytes, unseal
from shared.tasks import stop_following

log = logging.getLogger(__name__)

CACHE_FILE = "certificates.json"


class CertsUnavailable(ZatteraError):
    """The secrets service did not hand out certificate keys (the reason never holds key material)."""


@dataclass(frozen=True, slots=True)
class ServedCert:
    hostname: str
    chain_pem: str
    key_pem: str
    not_after: float

    @property
    def pem(self) -> str:
        """Chain and key in one PEM: what HAProxy's ``set ssl cert`` and ``ssl.load_cert_chain`` take."""
        return self.chain_pem.rstrip("\n") + "\n" + self.key_pem


MAX_PAGES = 100_000
"""A page sequence longer than this is refused (a server whose cursor does not advance would loop forever)."""


@dataclass(frozen=True, slots=True)
class CertPages:
    """A whole certificate set as it arrived: the entries of every page, how many pages and bytes."""

    bundle: cpb.CertBundle
    pages: int
    size: int


async def open_bundle(conn: Connection, subject: str, *, timeout: float = 5.0) -> cpb.CertBundle:
    """Ask ``subject`` for a :class:`CertBundle` sealed to a key made for this one request."""
    key = PrivateKey.generate()
    return (await _ask(conn, subject, key, cpb.OpenCertKeysRequest(public_key=public_bytes(key)), timeout))[0]


async def open_cert_pages(conn: Connection, subject: str, *, timeout: float = 5.0, max_bytes: int = 0) -> CertPages:
    """Every page of the certificate set on ``subject``: all sealed to one key made for this fetch (the
    server keeps no state between pages; a sealed box is fresh per message whatever the recipient key, so
    one key costs nothing in secrecy and keeps one secret in memory for the fetch, dropped after it). A server
    from before paging answers without ``more``: one page, the whole set. Raises :class:`CertsUnavailable`
    on any failure, page 1 or later; nothing from an incomplete sequence is returned. ``max_bytes`` (default:
    the connection's ``max_payload``) bounds each page's message."""
    key = PrivateKey.generate()
    whole = cpb.CertBundle()
    after, pages, size = "", 0, 0
    while True:
        request = cpb.OpenCertKeysRequest(
            public_key=public_bytes(key), paged=True, after=after, max_bytes=max_bytes or conn.nc.max_payload
        )
        page, got = await _ask(conn, subject, key, request, timeout)
        pages, size = pages + 1, size + got
        whole.certs.extend(page.certs)
        if not page.more:
            return CertPages(whole, pages, size)
        if page.next_after <= after or pages >= MAX_PAGES:
            raise CertsUnavailable(f"page {pages}: the cursor did not advance past {after!r}")
        after = page.next_after


async def _ask(
    conn: Connection, subject: str, key: PrivateKey, request: cpb.OpenCertKeysRequest, timeout: float
) -> tuple[cpb.CertBundle, int]:
    try:
        msg = await conn.nc.request(subject, request.SerializeToString(), timeout=timeout)
    except Exception as exc:  # no responder, timeout, connection trouble: the caller retries
        raise CertsUnavailable(f"the secrets service did not answer ({type(exc).__name__})") from None
    try:
        response = cpb.OpenCertKeysResponse.FromString(msg.data)
    except Exception:
        raise CertsUnavailable("the answer was malformed") from None
    if response.error:
        raise CertsUnavailable(response.error)
    try:
        return cpb.CertBundle.FromString(unseal(key, response.sealed)), len(msg.data)
    except CryptoError:
        raise CertsUnavailable("the answer was not sealed to this request's key") from None


def bundle_certs(bundle: cpb.CertBundle) -> dict[str, ServedCert]:
    return {
        e.hostname: ServedCert(e.hostname, e.chain_pem, e.key_pem, from_timestamp(e.not_after)) for e in bundle.certs
    }


def load_cache(path: Path) -> dict[str, ServedCert]:
    try:
        doc = json.loads(path.read_text())
        return {host: ServedCert(**fields) for host, fields in doc["certs"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("certificates: cache %s unreadable (%s); starting empty", path, type(exc).__name__)
        return {}


class CertClient:
    def __init__(self, cache_path: Path, *, refresh: float = 300.0, retry: float = 2.0, timeout: float = 5.0) -> None:
        self.cache_path = cache_path
        self.timeout = timeout  # per page
        self.pages = 0  # pages of the last complete fetch
        self.refresh_interval = refresh
        self.retry_interval = retry
        self.current: Mapping[str, ServedCert] = load_cache(cache_path)
        self.version = 0  # +1 on every new set
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._conn: Connection | None = None
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, conn: Connection) -> None:
        self._conn = conn

        async def on_notice(_msg: object) -> None:
            self._wake.set()

        self._sub = await conn.nc.subscribe(CHANGED_SUBJECT, cb=on_notice)
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        await stop_following(self._task, self._sub)
        self._task, self._sub = None, None
        self._conn = None

    async def fetch(self) -> bool:
        """Fetch the set once; True when it differs from the current one (and was cached and announced)."""
        assert self._conn is not None, "start() first"
        fetched = await open_cert_pages(self._conn, KEYS_OPEN_SUBJECT, timeout=self.timeout)
        self.pages = fetched.pages
        certs = bundle_certs(fetched.bundle)
        if certs == dict(self.current):
            return False
        self.current = certs
        await asyncio.to_thread(
            write_private_json, self.cache_path, {"certs": {h: asdict(c) for h, c in certs.items()}}
        )
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def _follow(self) -> None:
        while True:
            self._wake.clear()
            wait = self.refresh_interval
            try:
                await self.fetch()
            except CertsUnavailable as exc:
                log.warning("certificates: keeping the %d current certificate(s): %s", len(self.current), exc)
                wait = self.retry_interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def updates(self) -> AsyncIterator[Mapping[str, ServedCert]]:
        """The current set at once, then every new one (latest wins). A set that arrives while the reader
        handles the previous one is handed out next, at once: the version is looked at again after every
        yield, before waiting (a reader slow to install a set, e.g. HAProxy still starting, once missed the
        set that came meanwhile until the next change, up to the 5-minute refresh)."""
        seen = -1
        while True:
            if self.version != seen:
                seen = self.version
                yield self.current
                continue
            await self._changed.wait()
