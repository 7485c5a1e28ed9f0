"""The heartbeat file and the health check that reads it (shared/health.py, shared/health.sh): the check's
verdicts on real files with set times, and a process shell on a real nats-server touching its file only
while connected, removing it when it stops."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

import shared.health
from shared.connection import connect
from shared.embedded import EmbeddedNats
from shared.health import CHECK, touch
from shared.process import Process
from shared.settings import Settings
from tests.waiting import eventually


def check(path: Path) -> tuple[int, str]:
    done = subprocess.run(["/bin/sh", str(CHECK), str(path)], capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout


def set_mtime(path: Path, when: float) -> None:
    os.utime(path, (when, when))


def test_the_check_asks_for_a_heartbeat_since_the_previous_check(tmp_path: Path) -> None:
    beat, checked = tmp_path / "health", tmp_path / "health.checked"
    code, said = check(beat)
    assert code == 1 and "no heartbeat in" in said, "not running yet"
    touch(beat)
    assert check(beat) == (0, ""), "the first check: the file exists"
    assert checked.exists()
    now = time.time()
    set_mtime(checked, now)
    set_mtime(beat, now - 1)
    code, said = check(beat)
    assert code == 1 and "since the previous check" in said, "no beat since the previous check"
    set_mtime(beat, checked.stat().st_mtime + 1)  # a beat after that check
    assert check(beat) == (0, "")
    set_mtime(checked, beat.stat().st_mtime + 1)  # that check ran after the beat
    assert check(beat)[0] == 1, "checked again without a beat in between"


def test_a_process_restarted_in_its_container_is_unhealthy_until_it_beats(tmp_path: Path) -> None:
    """A killed process leaves its file behind (it removes it only when it stops cleanly)."""
    beat = tmp_path / "health"
    touch(beat)
    assert check(beat)[0] == 0
    set_mtime(beat, time.time() - 60)  # the old process's last beat, before the last check
    assert check(beat)[0] == 1
    touch(beat)
    set_mtime(beat, time.time() + 1)
    assert check(beat)[0] == 0


async def test_the_shell_beats_while_connected_and_removes_the_file_when_it_stops(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared.health, "HEARTBEAT", 0.05)
    path = tmp_path / "health"
    shell = Process("probe", argparse.Namespace(nats=None), Settings(health_file=str(path)), asyncio.Event(), False)
    conn = await connect(nats_server.url, name="probe")
    supervising = asyncio.create_task(shell.supervise([], conn))

    def beat_after(moment: float) -> bool:
        return path.exists() and path.stat().st_mtime > moment

    try:
        await eventually(lambda: beat_after(0), 10, "a first heartbeat")
        nats_server.stop()
        await eventually(lambda: not conn.nc.is_connected, 10, "disconnected")
        # reconnecting: no beat. One beat at most may have been under way as the connection dropped.
        await eventually(lambda: time.time() - path.stat().st_mtime > 0.5, 10, "the beats stop")
        nats_server.start()
        restarted = time.time()
        await eventually(lambda: beat_after(restarted), 30, "beating again once reconnected")
        shell.stop.set()
        assert await asyncio.wait_for(supervising, 10) == 0
        assert not path.exists(), "a stopped process leaves no heartbeat behind"
    finally:
        supervising.cancel()
        await conn.close()


async def test_a_process_without_a_connection_beats_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy supervises without a connection of its own (its data plane keeps one)."""
    monkeypatch.setattr(shared.health, "HEARTBEAT", 0.05)
    path = tmp_path / "health"
    shell = Process("proxy", argparse.Namespace(nats=None), Settings(health_file=str(path)), asyncio.Event(), False)
    supervising = asyncio.create_task(shell.supervise([]))
    await eventually(path.exists, 10, "a first heartbeat")
    first = path.stat().st_mtime_ns
    await eventually(lambda: path.stat().st_mtime_ns > first, 10, "a second heartbeat")
    shell.stop.set()
    assert await asyncio.wait_for(supervising, 10) == 0
    assert not path.exists()
