"""The one process shell (shared/process.py): retries until stopped, fatal errors propagate, exit statuses
of supervision, tasks left running at the end cannot keep a process alive, and the agent and the proxy start
in it (a real agent process, SIGTERM while NATS is away)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import shared.process
from shared.embedded import free_port
from shared.process import Process, end_leftovers
from shared.settings import Settings
from tests.waiting import BlocksUntilCancelled, eventually

ROOT = Path(__file__).resolve().parents[2]


async def test_a_task_that_swallows_its_cancellations_cannot_keep_the_process_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released = asyncio.Event()
    swallowed = 0

    async def stubborn() -> None:  # what a retry loop around a library that swallows a cancellation does
        nonlocal swallowed
        while not released.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1

    async def polite() -> None:
        await asyncio.sleep(3600)

    kept = asyncio.create_task(stubborn(), name="githooks-consumer")
    ends = asyncio.create_task(polite(), name="polite")
    await asyncio.sleep(0)  # both started (a task cancelled before its first step never runs)
    exits: list[int] = []
    await end_leftovers("probe", 0.3, exit_now=exits.append)
    assert exits == [1] and ends.cancelled() and not kept.done()
    assert swallowed >= 1, "cancelled again while it ran"
    assert "probe: 1 task(s) did not end when cancelled (githooks-consumer); exiting anyway" in caplog.text

    released.set()
    kept.cancel()
    await asyncio.wait({kept}, timeout=5)
    assert kept.done()
    exits.clear()
    await end_leftovers("probe", 0.3, exit_now=exits.append)
    assert exits == [], "nothing left: no exit forced"


async def test_a_stop_whose_clean_up_fails_still_says_it_stopped(caplog: pytest.LogCaptureFixture) -> None:
    async def failing() -> None:
        raise RuntimeError("the connection is already closed")

    caplog.set_level(logging.INFO, logger="shared.process")
    await process().shut_down(failing, grace=5)
    assert "probe: stop: clean-up failed: RuntimeError('the connection is already closed')" in caplog.text
    assert "probe: stopped" in caplog.text


def process() -> Process:
    return Process("probe", argparse.Namespace(nats=None), Settings(), asyncio.Event(), metrics=False)


async def test_retry_retries_what_it_may_and_raises_what_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared.process, "FIRST_RETRY", 0.001)
    shell = process()
    attempts: list[int] = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError("not yet")
        return "ok"

    assert await shell.retry(flaky, what="flaky", retry_on=(OSError,)) == "ok"
    assert len(attempts) == 3

    async def refused() -> None:
        raise PermissionError("refused")

    with pytest.raises(PermissionError):
        await shell.retry(refused, what="refused", retry_on=(OSError,), fatal=(PermissionError,))
    shell.stop.set()
    assert await shell.retry(flaky, what="stopped") is None


async def test_a_stop_does_not_wait_for_the_attempt_under_way() -> None:
    """A connect to an unreachable NATS takes 10 s per attempt: a SIGTERM meanwhile used to wait for it
    (the ingress and proxy benches' stopped processes outlived their 10 s wait)."""
    shell = process()
    hangs = BlocksUntilCancelled()
    retrying = asyncio.create_task(shell.retry(hangs, what="hangs"))
    await hangs.started.wait()
    shell.stop.set()
    assert await asyncio.wait_for(retrying, 5) is None
    assert hangs.cancelled.is_set()


async def test_supervise_exits_0_when_stopped_and_1_when_a_task_ends_or_fails() -> None:
    shell = process()
    forever = asyncio.create_task(asyncio.Event().wait())
    shell.stop.set()
    assert await shell.supervise([forever]) == 0
    forever.cancel()

    async def boom() -> None:
        raise RuntimeError("boom")

    async def done() -> None:
        return None

    assert await process().supervise([asyncio.create_task(boom())]) == 1
    assert await process().supervise([asyncio.create_task(done())]) == 1


def test_an_agent_waiting_for_nats_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    nats = f"nats://127.0.0.1:{free_port()}"  # nobody listens: the shell keeps retrying
    argv = [sys.executable, "-m", "services.agent", "--nats", nats, "--node-id", "n1", "--data-dir", str(tmp_path)]
    env = {**os.environ, "ZATTERA_AGENT_RUNTIME": "process"}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            asyncio.run(eventually(lambda: "unreachable" in log.read_text(), timeout=20, what="retrying"))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
