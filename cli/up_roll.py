"""Rolling a running ``zattera up`` onto newly installed code: the supervisor's pid file and lock, the code's
identity, and the request another ``zattera up`` sends it (docs/upgrades.md)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from cli.supervised import PROJECT_ROOT

PID_FILE = "up.pid"
"""``<data_dir>/up.pid``: the running supervisor's pid, locked (``flock``) for as long as it lives."""


ROLL_LOG = "up-roll.log"
"""``<data_dir>/up-roll.log``: the progress of the last roll, which the requesting ``zattera up`` prints."""


ROLL_SIGNAL = signal.SIGUSR1
"""Sent to the supervisor: roll every process onto the code installed now."""


RESTART_SIGNAL = signal.SIGUSR2
"""Sent to one process: stop to be started again at once (``shared.process.RESTART_SIGNAL``; not imported:
the supervisor loads no asyncio)."""


ROLL_DONE, ROLL_REFUSED = "done:", "refused:"


CODE_DIRS = ("shared", "services", "cli", "proto")


def code_identity(root: Path = PROJECT_ROOT) -> str:
    """What the installed code is, cheaply: every source file's path, size and modification time (a pull
    or a checkout changes them)."""
    digest = hashlib.sha256()
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path.relative_to(root)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def hold_supervisor_lock(data_dir: Path) -> IO[str] | None:
    """Lock ``<data_dir>/up.pid`` for this process's life and write its pid there; None when another
    supervisor holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = (data_dir / PID_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def running_supervisor(data_dir: Path) -> int | None:
    """The pid of the supervisor running from ``data_dir``, or None."""
    path = data_dir / PID_FILE
    if not path.exists():
        return None
    with path.open("r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = handle.read().strip()
            return int(text) if text.isdigit() else None
    return None


def request_roll(data_dir: Path, pid: int, *, timeout: float = 900.0, out: Callable[[str], None] = print) -> int:
    """Ask the supervisor ``pid`` to roll its processes onto the code installed now and print its progress
    until it is done: 0 when done, 1 when refused or cut short."""
    log = data_dir / ROLL_LOG
    log.write_text("")
    os.kill(pid, ROLL_SIGNAL)
    out(f"zattera up is running from {data_dir} (pid {pid}): rolling its processes onto the code installed now")
    seen = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines()
        for line in lines[seen:]:
            out(f"  {line}")
            if line.startswith(ROLL_DONE):
                return 0
            if line.startswith(ROLL_REFUSED):
                return 1
        seen = len(lines)
        if running_supervisor(data_dir) != pid:
            out(f"the supervisor (pid {pid}) stopped before it was done")
            return 1
        time.sleep(0.2)
    out(f"no end of the roll within {timeout:.0f}s: see {log}")
    return 1
