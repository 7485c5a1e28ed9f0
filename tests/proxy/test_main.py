"""``python -m services.proxy`` as a real process: flags, serving, heartbeat, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import Connection
from shared.embedded import free_port
from shared.live import proxy_key
from shared.subjects import LIVE_BUCKET
from tests.proxy.harness import HOST, Backend, Routes, endpoint, http_route, serving
from tests.waiting import eventually

PROJECT_ROOT = Path(__file__).resolve().parents[2]


async def test_process_serves_reports_and_exits_cleanly_on_sigterm(
    nats_url: str, conn: Connection, routes: Routes, tmp_path: Path
) -> None:
    backend = Backend("from-process")
    port = free_port()
    async with serving(backend), aiohttp.ClientSession() as client:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.proxy",
            "--nats",
            nats_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--proxy-id",
            "proc",
            "--node-id",
            "n7",
            "--cache-dir",
            str(tmp_path / "cache"),
            cwd=PROJECT_ROOT,
            env={"PATH": "/usr/bin:/bin", "ZATTERA_PROXY_HEARTBEAT_INTERVAL": "0.2"},
        )
        try:
            live = await conn.js.key_value(LIVE_BUCKET)

            async def reporting() -> bool:
                try:
                    entry = await live.get(proxy_key("proc"))
                except Exception:
                    return False
                return cpb.ProxyHeartbeat.FromString(entry.value or b"").node_id == "n7"

            await eventually(reporting, 15, "the process's heartbeat")  # connected, so subscribed to routes
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
