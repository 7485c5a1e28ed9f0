"""One process ``zattera up`` supervises: started, watched, restarted with backoff when it dies, stopped with
a grace period; and :func:`port_free`, whether a port the supervisor would give one is free."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shared.subprocesses import spawn_logged

PROJECT_ROOT = Path(__file__).resolve().parents[1]

RESTART_FIRST = 0.5
"""Seconds before a process that died is started again; doubling per restart within a minute of its start."""


RESTART_MOST = 30.0
"""``zattera up``'s first metrics port: scheduler 9400, orchestrator 9401, … in start order."""


@dataclass
class Supervised:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0

    def start(self, *, die_with_parent: bool = False) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = spawn_logged(
            self.argv, self.log_path, cwd=PROJECT_ROOT, env=self.env, die_with_parent=die_with_parent
        )
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def started_since(self, offset: int) -> bool:
        """Its log, past ``offset``, says that it started (``<name>: Zattera <version> (schema N) starting``)."""
        if not self.log_path.exists():
            return False
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return b": Zattera " in log.read() and self.alive()

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def port_free(port: int) -> bool:
    """Whether ``127.0.0.1:port`` can be bound now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
