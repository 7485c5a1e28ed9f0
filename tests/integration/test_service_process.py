"""Service entry points as real processes: start, wait for NATS, stop cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from shared.embedded import EmbeddedNats, free_port
from shared.service import ServiceContext, serve
from tests.leases import LOOPS_OF, SERVICE_OF_LOOP, held_leases, lease_holders
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
SERVICES = [*sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py")), "allinone"]
MODULES = {"allinone": "cli.control_plane"}  # every service in one process (zattera up's default)


def start(service: str, url: str, log: Path, lease_ttl: float = 1) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ZATTERA_LEASE_TTL": str(lease_ttl),
        "ZATTERA_LEASE_RENEW": "0.3",
        "ZATTERA_DATA_DIR": str(log.parent),  # the secrets service makes its key file there
        "ZATTERA_CONSOLE_PORT": "0",  # a free one
    }
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", MODULES.get(service, f"services.{service}"), "--nats", url],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.parametrize("service", [s for s in SERVICES if s not in ("agent", "proxy")])
async def test_service_starts_and_stops_cleanly_on_sigterm(service, nats_url, tmp_path, conn):
    log = tmp_path / f"{service}.log"
    # A TTL far longer than the test, so a lease still there was not released (expiry cannot hide it).
    proc = start(service, nats_url, log, lease_ttl=120)
    try:
        await eventually(lambda: "running" in log.read_text(), timeout=30, what=f"{service} running")
        loops = LOOPS_OF[service]
        if loops:

            async def leading_every_loop() -> bool:
                return await held_leases(conn, loops) == loops

            await eventually(leading_every_loop, timeout=30, what=f"{service} leading {sorted(loops)}")
            # Each loop leads under the name of the service it belongs to, in the all-in-one process too.
            holders = await lease_holders(conn, loops)
            assert {loop: h.split("@")[0] for loop, h in holders.items()} == {
                loop: SERVICE_OF_LOOP[loop] for loop in loops
            }
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{service} did not stop on SIGTERM:\n{log.read_text()}") from None
        assert code == 0, log.read_text()
        assert "stopped" in log.read_text()
        assert await held_leases(conn, loops) == set(), "leases released on SIGTERM, not left to expire"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_service_waits_for_nats_and_connects_when_it_appears(tmp_path):
    port = free_port()
    log = tmp_path / "scheduler.log"
    proc = start("scheduler", f"nats://127.0.0.1:{port}", log)
    server = None
    try:
        await eventually(lambda: "unreachable" in log.read_text(), timeout=20, what="retrying")
        assert proc.poll() is None
        server = EmbeddedNats(data_dir=tmp_path / "nats", port=port).start()
        await eventually(lambda: "running" in log.read_text(), timeout=30, what="connected after the outage")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server:
            server.stop()


async def test_a_task_that_fails_makes_the_process_exit_non_zero(nats_url):
    async def build(ctx: ServiceContext) -> list[Coroutine[Any, Any, None]]:
        async def crash() -> None:
            raise RuntimeError("boom")

        return [crash()]

    assert await serve("crashy", build, ["--nats", nats_url]) == 1


async def test_a_connection_closed_for_good_makes_the_process_exit_non_zero(nats_url):
    """nats-py never reconnects a connection the server dropped over a protocol error: a process left with
    it is alive but deaf, so it exits (and its supervisor restarts it)."""

    async def build(ctx: ServiceContext) -> list[Coroutine[Any, Any, None]]:
        async def deaf() -> None:
            await ctx.conn.nc.close()  # as nats-py does after such a drop: closed, not by Connection.close()
            await asyncio.Event().wait()

        return [deaf()]

    assert await serve("deaf", build, ["--nats", nats_url]) == 1
