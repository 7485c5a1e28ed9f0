from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.proxy.server import Proxy
from shared.connection import Connection
from tests.proxy.harness import ProxyFactory, Routes, start_proxy


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
