"""The HAProxy master of one :class:`Layout`: started, adopted after a crash of the proxy process, watched, stopped.

HAProxy runs in its own session with no parent-death signal, so the data plane outlives the proxy process:
killed (SIGKILL, OOM, a bug), the proxy leaves HAProxy serving the last routes. The master writes its pid
to ``Layout.pid_file`` (``-p``, again at every reload). The next proxy process adopts that HAProxy
(:func:`adopt`) only when it is this layout's: alive, this user's, ``/proc/<pid>/cmdline`` haproxy with this
layout's configuration file, and its master CLI naming that pid as the master. A stale file (the process
gone, the pid reused by another program) is ignored. An adopted master is not our child: the event loop
learns of its exit from a pidfd (:func:`os.pidfd_open`). A clean stop soft-stops it and removes the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from services.proxy.haproxy_config import Layout
from services.proxy.haproxy_runtime import ask
from services.proxy.launch import HAPROXY

log = logging.getLogger(__name__)

MASTER_ANSWER_TIMEOUT = 5.0
"""How long an adopted master may take to answer on its master CLI (it re-executes itself on a reload, its
socket bound again): past it, this layout's HAProxy is killed and a new one started."""


class Master:
    """A running HAProxy master: our child, or adopted from a proxy process that crashed (its exit learnt
    from a pidfd; its exit status is not ours to read)."""

    def __init__(self, pid: int, *, child: asyncio.subprocess.Process | None = None, pidfd: int | None = None) -> None:
        self.pid = pid
        self.child = child
        self.old_workers: set[int] = set()
        """An adopted master's workers of before its last reload (they keep their connections, WebSockets)."""
        self._pidfd = pidfd
        self._gone = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if pidfd is not None:
            self._loop.add_reader(pidfd, self._exited_now)

    @property
    def adopted(self) -> bool:
        return self.child is None

    @property
    def exited(self) -> bool:
        return self.child.returncode is not None if self.child is not None else self._gone.is_set()

    @property
    def returncode(self) -> int | None:
        return self.child.returncode if self.child is not None else None

    def _exited_now(self) -> None:
        self.close()
        self._gone.set()

    def close(self) -> None:
        """Stop watching an adopted master (its pidfd closed)."""
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    async def wait(self) -> int | None:
        """Until it exits; the exit status of a child, None for an adopted master."""
        if self.child is not None:
            return await self.child.wait()
        await self._gone.wait()
        return None

    def signal(self, sig: int) -> None:
        """Signal the master itself (an adopted one through its pidfd: never a process that reused its pid)."""
        with contextlib.suppress(ProcessLookupError):
            if self.child is not None:
                self.child.send_signal(sig)
            elif self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)

    async def stop(self, grace: float) -> None:
        """Soft stop (SIGUSR1: the listeners close, in-flight requests finish), SIGKILL after ``grace`` seconds."""
        if not self.exited:
            self.signal(signal.SIGUSR1)
            try:
                await asyncio.wait_for(self.wait(), grace)
            except TimeoutError:
                await self.kill()
        self.close()

    async def kill(self) -> None:
        """SIGKILL, and until it is gone (its workers exit by themselves once their master is gone)."""
        self.signal(signal.SIGKILL)
        await self.wait()


def private_dir(path: Path) -> None:
    """A directory only this user can enter (it holds the admin sockets); refuses one someone else owns."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user: not keeping the haproxy sockets there")
    path.chmod(0o700)


async def spawn(layout: Layout, binary: str) -> Master:
    """Start HAProxy on ``layout``'s configuration (written): master-worker, in its own session, its pid in
    ``layout.pid_file``; it outlives this process unless stopped."""
    for stale in (layout.master_socket, layout.stats_socket):
        stale.unlink(missing_ok=True)  # never mistake a previous HAProxy's socket for this one's
    output = open(layout.directory / "haproxy.log", "ab")  # noqa: SIM115, ASYNC230 - the child keeps it
    try:
        child = await asyncio.create_subprocess_exec(
            binary,
            "-W",
            "-db",
            "-f",
            str(layout.config_file),
            "-S",
            f"{layout.master_socket},mode,600",
            "-p",
            str(layout.pid_file),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
        )
    finally:
        output.close()
    return Master(child.pid, child=child)


def recorded_pid(layout: Layout) -> int | None:
    """The pid in ``layout.pid_file``; None when there is none (no file, empty, not a pid)."""
    try:
        text = layout.pid_file.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def command_line(pid: int) -> list[str]:
    """``/proc/<pid>/cmdline`` split into its arguments; empty when gone (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def runs_layout(argv: Sequence[str], layout: Layout, binary: str) -> bool:
    """Whether ``argv`` is HAProxy's on ``layout``'s configuration file (a reload adds ``-sf``/``-x``, keeps ``-f``)."""
    if not argv or Path(argv[0]).name not in {Path(binary).name, HAPROXY}:
        return False
    config = str(layout.config_file)
    return any(flag == "-f" and value == config for flag, value in itertools.pairwise(argv))


def _owned(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _has_exited(pidfd: int) -> bool:
    """Whether the process a pidfd refers to has exited (the pidfd is readable)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def master_processes(answer: str) -> tuple[int | None, set[int]]:
    """The master CLI's ``show proc``: the master's pid, and the old workers' (those of before a reload)."""
    master: int | None = None
    old: set[int] = set()
    section = ""
    for line in answer.splitlines():
        if line.startswith("#"):
            section = line.strip("# ").lower()
            continue
        fields = line.split()
        if len(fields) < 2 or not fields[0].isdigit():
            continue
        if fields[1] == "master":
            master = int(fields[0])
        elif section == "old workers":
            old.add(int(fields[0]))
    return master, old


async def _master_answer(layout: Layout, pid: int) -> set[int] | None:
    """The old workers of the master ``pid`` when it answers as such on the master CLI within
    :data:`MASTER_ANSWER_TIMEOUT`; None when it does not."""
    deadline = time.monotonic() + MASTER_ANSWER_TIMEOUT
    while True:
        with contextlib.suppress(OSError, TimeoutError):
            master, old = master_processes(await ask(layout.master_socket, "show proc", timeout=2))
            if master == pid:
                return old
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.05)


async def adopt(layout: Layout, binary: str) -> Master | None:
    """The HAProxy master ``layout.pid_file`` names, when it is this layout's and answers on its master CLI;
    None otherwise. One of this layout's that does not answer is killed: a new one would share its ports
    (``SO_REUSEPORT``) while it served routes nobody updates."""
    pid = recorded_pid(layout)
    if pid is None:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None  # gone
    # Checked after the pidfd is open: the process checked is the one the pidfd holds while it has not exited.
    if not (_owned(pid) and runs_layout(command_line(pid), layout, binary)) or _has_exited(pidfd):
        os.close(pidfd)
        log.info("haproxy: pid file %s names no HAProxy of this directory (pid %d): ignored", layout.pid_file, pid)
        return None
    master = Master(pid, pidfd=pidfd)
    old_workers = await _master_answer(layout, pid)
    if old_workers is None or master.exited:
        if not master.exited:
            log.warning("haproxy: pid %d of this directory does not answer on its master socket: killed", pid)
            await master.kill()
        master.close()
        return None
    master.old_workers = old_workers
    return master
