"""Starting the processes the platform itself runs: daemons logging to a file (nats-server, the services
under ``zattera up``), and short shell commands whose exit status is all that matters (exec health checks,
snapshot pre-hooks).

asyncio is imported inside the coroutines: ``zattera up``'s lean supervisor uses :func:`spawn_logged` and
stays without an event loop's imports (about 6 MB), while any caller of a coroutine already has them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def terminated_with_parent() -> Callable[[], None]:
    """What a child runs between fork and exec so that it gets SIGTERM when this process dies, however it
    dies (SIGKILL, a crash): a supervisor that cannot clean up still leaves nothing behind. For a
    single-threaded parent only: Linux sends the signal when the forking *thread* ends."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def in_child() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
            os._exit(1)  # no promise possible, or the parent is already gone: do not start at all

    return in_child


def spawn_logged(
    argv: Sequence[str],
    log_path: Path,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start a daemon with no input, its stdout and stderr appended to ``log_path``, in a session of its own
    (a signal to this process's group, such as a terminal's Ctrl-C, does not reach it). ``die_with_parent``:
    it gets SIGTERM when this process dies (:func:`terminated_with_parent`)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=terminated_with_parent() if die_with_parent else None,  # the supervisor: single-threaded
        )


async def start_shell(
    command: str,
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdout: int = subprocess.DEVNULL,
    stderr: int = subprocess.DEVNULL,
    own_session: bool = False,
) -> asyncio.subprocess.Process:
    """``/bin/sh -c command`` started with no input, in ``cwd`` with exactly ``env``; ``own_session``: in a
    session (and process group) of its own, so that the whole group can be signalled."""
    import asyncio

    return await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        command,
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=own_session,
    )


async def run_shell(command: str, *, cwd: Path, env: Mapping[str, str], timeout: float | None = None) -> int:
    """The exit status of ``/bin/sh -c command``, run with no input and its output discarded. On a timeout
    (:class:`TimeoutError`) or a cancellation the process is killed and reaped before the error propagates."""
    import asyncio

    proc = await start_shell(command, cwd=cwd, env=env)
    try:
        async with asyncio.timeout(timeout):
            return await proc.wait()
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
