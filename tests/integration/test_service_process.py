"""Service entry points as real processes: start, wait for NATS, stop cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.embedded import EmbeddedNats, free_port
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py"))


def start(service: str, url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ZATTERA_LEASE_TTL": "1", "ZATTERA_LEASE_RENEW": "0.3"}
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", f"services.{service}", "--nats", url],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.parametrize("service", [s for s in SERVICES if s not in ("agent", "proxy")])
async def test_service_starts_and_stops_cleanly_on_sigterm(service, nats_url, tmp_path):
    log = tmp_path / f"{service}.log"
    proc = start(service, nats_url, log)
    try:
        await eventually(lambda: "running" in log.read_text(), timeout=30, what=f"{service} running")
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{service} did not stop on SIGTERM:\n{log.read_text()}") from None
        assert code == 0, log.read_text()
        assert "stopped" in log.read_text()
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
