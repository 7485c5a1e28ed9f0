"""HTTP-01 answers in a proxy (in-process, real NATS): answered before route matching for any Host, from
the watch or, for a token the watch has not delivered yet, a direct read; withdrawn answers and unknown or
malformed tokens fall through to the routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared.acmechallenge import PATH_PREFIX, publish_answer, withdraw_answer
from shared.connection import Connection


@pytest.fixture
async def proxy(nats_url: str, conn: Connection, tmp_path: Path) -> AsyncIterator[Proxy]:
    running = Proxy(ProxySettings(host="127.0.0.1", port=0, proxy_id="p"), nats_url=nats_url, cache_dir=tmp_path)
    await running.start()
    await running.wait_connected()
    try:
        yield running
    finally:
        await running.stop()


async def get(proxy: Proxy, path: str, host: str = "anything.example.com") -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as client,
        client.get(f"http://127.0.0.1:{proxy.port}{path}", headers={"Host": host}) as response,
    ):
        return response.status, await response.text()


async def test_answers_before_routes_then_falls_through_once_withdrawn(proxy: Proxy, conn: Connection) -> None:
    await publish_answer(conn, "tok-A", "tok-A.thumb")
    assert await get(proxy, PATH_PREFIX + "tok-A") == (200, "tok-A.thumb")
    await withdraw_answer(conn, "tok-A")
    status, _ = await get(proxy, PATH_PREFIX + "tok-A")
    assert status == 404  # no route for the host: the routes decide, as for any path


@pytest.mark.parametrize("token", ["unknown", "bad.token", "a*b", ""])
async def test_unknown_or_malformed_tokens_fall_through(proxy: Proxy, token: str) -> None:
    status, body = await get(proxy, PATH_PREFIX + token)
    assert status == 404 and "no route" in body
