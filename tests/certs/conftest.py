"""Fixtures of the certificate tests: pebble on loopback, the secrets service, a real proxy process."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.certs.issuer import AcmeIssuer
from services.certs.loop import CertificateLoop
from services.secrets.service import SecretsService
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection
from shared.embedded import free_port
from shared.live import proxy_key
from shared.loop import LoopDeps
from shared.secrets import CLUSTER_KEY
from shared.state.feed import StateView
from shared.subjects import LIVE_BUCKET
from shared.txn import Writer
from tests.certs.pebble import Pebble, running_pebble
from tests.secrets.test_service import secrets_service as running_secrets_service
from tests.waiting import eventually

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def proxy_port() -> int:
    return free_port()


@pytest.fixture
def pebble(tmp_path: Path, proxy_port: int) -> Iterator[Pebble]:
    with running_pebble(tmp_path / "pebble", proxy_port) as server:
        yield server


@pytest.fixture
async def secrets_service(nats_url: str, view: StateView, tmp_path: Path) -> AsyncIterator[SecretsService]:
    async with running_secrets_service(nats_url, tmp_path / "cluster.key") as running:
        await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the cluster key")
        yield running.service


@contextlib.asynccontextmanager
async def running_proxy(
    nats_url: str,
    http_port: int,
    cache_dir: Path,
    *extra: str,
    conn: Connection | None = None,
    proxy_id: str = "certs-test",
    path: str = "/usr/bin:/bin",
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A real proxy process on 127.0.0.1:``http_port``; yields once it listens and, given ``conn``, once it
    is connected (its first heartbeat follows the challenge subscription). ``path`` without ``/usr/sbin``
    keeps it on the Python engine."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.proxy",
        "--nats",
        nats_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--proxy-id",
        proxy_id,
        "--cache-dir",
        str(cache_dir),
        *extra,
        cwd=PROJECT_ROOT,
        env={"PATH": path},
    )

    async def connected() -> bool:
        assert conn is not None
        try:
            await (await conn.js.key_value(LIVE_BUCKET)).get(proxy_key(proxy_id))
        except Exception:
            return False
        return True

    try:
        await eventually(lambda: listening(http_port), 15, "the proxy process listens")
        if conn is not None:
            await eventually(connected, 15, "the proxy process is connected")
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


@pytest.fixture
async def proxy_process(nats_url: str, conn: Connection, proxy_port: int, tmp_path: Path) -> AsyncIterator[int]:
    """A real proxy on 127.0.0.1:``proxy_port`` (pebble's HTTP-01 port); yields its port once it answers."""
    async with running_proxy(nats_url, proxy_port, tmp_path / "proxy-cache", conn=conn):
        yield proxy_port


@dataclass
class Rig:
    conn: Connection
    view: StateView
    writer: Writer
    clock: FakeClock
    pebble: Pebble

    def loop(self, directory_url: str | None = None) -> CertificateLoop:
        acme = AcmeIssuer(
            directory_url or self.pebble.directory_url,
            "ops@example.com",
            ca_bundle=str(self.pebble.ca_bundle),
            order_timeout=20,
        )
        loop = CertificateLoop(LoopDeps(self.conn, self.view, self.clock, coalesce=0), acme=acme)
        loop.writer = self.writer
        return loop

    async def add_domain(self, hostname: str) -> None:
        domain = pb.Domain(hostname=hostname, environment_id="env-certs", project_id="p")
        domain.meta.id = K.cert_id(hostname)
        await self.writer.commit(self.writer.txn().create(domain))

    def cert(self, hostname: str) -> pb.Certificate:
        cert = self.view.get(K.CERT, K.cert_id(hostname))
        assert isinstance(cert, pb.Certificate), f"no certificate record for {hostname}"
        return cert


@pytest.fixture
async def rig(
    conn: Connection,
    view: StateView,
    writer: Writer,
    pebble: Pebble,
    secrets_service: SecretsService,
    proxy_process: int,
) -> Rig:
    return Rig(conn, view, writer, FakeClock(start=time.time()), pebble)
