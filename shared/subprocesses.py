"""Starting the processes the platform itself runs: daemons logging to a file (nats-server, the services
under ``zattera up``), and short shell commands whose exit status is all that matters (exec health checks,
snapshot pre-hooks)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def spawn_logged(
    argv: Sequence[str], log_path: Path, *, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a daemon with no input, its stdout and stderr appended to ``log_path``, in a session of its own
    (a signal to this process's group, such as a terminal's Ctrl-C, does not reach it)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )


async def start_shell(
    command: str,
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdout: int = asyncio.subprocess.DEVNULL,
    stderr: int = asyncio.subprocess.DEVNULL,
    own_session: bool = False,
) -> asyncio.subprocess.Process:
    """``/bin/sh -c command`` started with no input, in ``cwd`` with exactly ``env``; ``own_session``: in a
    session (and process group) of its own, so that the whole group can be signalled."""
    return await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        command,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=own_session,
    )


async def run_shell(command: str, *, cwd: Path, env: Mapping[str, str], timeout: float | None = None) -> int:
    """The exit status of ``/bin/sh -c command``, run with no input and its output discarded. On a timeout
    (:class:`TimeoutError`) or a cancellation the process is killed and reaped before the error propagates."""
    proc = await start_shell(command, cwd=cwd, env=env)
    try:
        async with asyncio.timeout(timeout):
            return await proc.wait()
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
