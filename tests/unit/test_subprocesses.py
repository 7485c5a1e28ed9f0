"""The platform's own processes (``shared/subprocesses.py``): real processes, no sleeps on timers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from shared.subprocesses import run_shell, spawn_logged
from tests.waiting import eventually


@pytest.mark.parametrize(("command", "status"), [("true", 0), ("exit 3", 3), ("test -f missing", 1)])
async def test_run_shell_returns_the_exit_status(tmp_path: Path, command: str, status: int) -> None:
    assert await run_shell(command, cwd=tmp_path, env=os.environ) == status


async def test_run_shell_runs_in_the_directory_with_the_environment(tmp_path: Path) -> None:
    assert await run_shell('test "$PWD" = "$WANT"', cwd=tmp_path, env={"WANT": str(tmp_path)}) == 0


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_run_shell_kills_what_it_gives_up_on(tmp_path: Path, how: str) -> None:
    command = "echo $$ > pid; exec sleep 60"
    timeout = 0.5 if how == "timeout" else None
    task = asyncio.create_task(run_shell(command, cwd=tmp_path, env=os.environ, timeout=timeout))
    await eventually(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip() != "", what="pid")
    pid = int((tmp_path / "pid").read_text())
    if how == "cancel":
        task.cancel()
    with pytest.raises(TimeoutError if how == "timeout" else asyncio.CancelledError):
        await task
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_spawn_logged_appends_both_streams_to_the_log(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    log.write_text("before\n")
    proc = spawn_logged(["/bin/sh", "-c", "echo out; echo err >&2"], log, cwd=tmp_path)
    assert proc.wait(timeout=10) == 0
    assert log.read_text().splitlines()[0] == "before"
    assert sorted(log.read_text().splitlines()[1:]) == ["err", "out"]
