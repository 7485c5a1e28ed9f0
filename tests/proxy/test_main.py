"""``python -m services.proxy`` as a real process: flags, serving, heartbeat, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp

from shared.connection import Connection
from shared.embedded import free_port
from tests.proxy.harness import (
    HOST,
    Backend,
    Routes,
    endpoint,
    first_heartbeat,
    http_route,
    proxy_flags,
    proxy_module,
    serving,
)
from tests.waiting import eventually


async def test_process_serves_reports_and_exits_cleanly_on_sigterm(
    nats_url: str, conn: Connection, routes: Routes, tmp_path: Path
) -> None:
    backend = Backend("from-process")
    port = free_port()
    async with serving(backend), aiohttp.ClientSession() as client:
        flags = proxy_flags(nats_url, port, tmp_path / "cache", engine="python", proxy_id="proc", node_id="n7")
        process = await proxy_module(*flags, env={"ZATTERA_PROXY_HEARTBEAT_INTERVAL": "0.2"})
        try:
            beat = await first_heartbeat(conn, "proc", 15)  # connected, so subscribed to routes
            assert beat.node_id == "n7"
            await routes.publish(http_route(HOST, endpoints=[endpoint(backend.addr)]))

            async def served() -> bool:
                try:
                    async with client.get(f"http://127.0.0.1:{port}/", headers={"Host": HOST}) as response:
                        return response.status == 200 and await response.text() == "from-process"
                except aiohttp.ClientError:
                    return False

            await eventually(served, 10, "a request through the process")
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 10) == 0
            assert (tmp_path / "cache" / "routes.pb").exists()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
