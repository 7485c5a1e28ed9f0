from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.proxy.server import Proxy
from shared.connection import Connection
from tests.proxy.harness import ProxyFactory, Routes, kill_haproxy_under, start_proxy


@pytest.fixture(autouse=True)
def no_haproxy_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A safety net: HAProxy outlives the proxy that started it unless stopped cleanly, so any HAProxy a
    test leaves naming its tmp dir (a failed start, a test that killed its proxy) is killed after it."""
    tmp: Path | None = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        kill_haproxy_under(tmp)


@pytest.fixture
def routes(conn: Connection) -> Routes:
    return Routes(conn)


@pytest.fixture
async def make_proxy(nats_url: str, tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    started: list[Proxy] = []

    async def make(**overrides: Any) -> Proxy:
        proxy = await start_proxy(nats_url, tmp_path / f"proxy-{len(started)}", **overrides)
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        await proxy.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
