"""Instance processes: spawning, stopping, adopting after an agent restart, and host ports.

Each instance runs in its own session (``start_new_session``), so signals aimed at the agent never reach
it and the agent can stop the whole process group (the app and whatever it forked). A sandboxed instance
(``sandbox.py``) is the same tree with bubblewrap at its top: signals go to the processes inside it, exec
health checks join its namespaces, and its exit code is translated back from bwrap's. Its stdout and stderr
go to ``<instance>/stdout.log`` and ``<instance>/stderr.log``, never to a pipe, so they survive the agent
(``logs.py`` ships them). A small state file
``<instance>/state.json`` records the pid, the process's creation time and the config it runs: a
restarted agent adopts the process only when that pid still is that very process (same creation time,
per psutil), which rules out a recycled pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path

import psutil

from services.agent.logs import open_output_files
from services.agent.sandbox import Confinement, Sandbox, exit_status, sandbox_init, signal_inside
from shared.applogs import STDERR, STDOUT
from shared.files import PRIVATE, write_atomic

STATE_FILE = "state.json"
_CREATE_TIME_TOLERANCE = 0.05
_GROUP_POLL_INTERVAL = 0.05
SANDBOX_EXIT_GRACE = 5.0
"""After a sandboxed command exited: how long what it left in its sandbox may take to exit by itself before
the whole sandbox is killed. The instance has not exited until its sandbox is empty: bwrap reports the
command's exit at once while its pid 1 stays until every orphan is gone, and those orphans (a crashed
PostgreSQL's backends, checkpointer and archiver: each its own session, out of reach of the group's
SIGKILL) must never overlap the instance's next start on the same volume (docs/addons.md,
"Archiving after a crash")."""
SANDBOX_KILL_WAIT = 10.0
"""How long the kernel is given to kill a sandbox's processes once its pid 1 got SIGKILL."""
SANDBOX_FIND_WAIT = 2.0
"""How long a new sandbox's pid 1 is looked for after bwrap started."""


@dataclass
class InstanceRecord:
    """What survives an agent restart about one instance (``<instance>/state.json``); the working directory
    and environment are kept for exec health checks of an adopted process."""

    assignment_id: str
    config: str
    pid: int = 0
    create_time: float = 0.0
    container_id: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    sandbox_uid: int = 0
    """The uid a sandboxed process runs as (0: not sandboxed)."""

    def save(self, instance_dir: Path) -> None:
        write_atomic(instance_dir / STATE_FILE, json.dumps(asdict(self)), mode=PRIVATE)

    @classmethod
    def load(cls, instance_dir: Path) -> InstanceRecord | None:
        try:
            doc = json.loads((instance_dir / STATE_FILE).read_text())
            return cls(
                assignment_id=str(doc["assignment_id"]),
                config=str(doc["config"]),
                pid=int(doc.get("pid", 0)),
                create_time=float(doc.get("create_time", 0.0)),
                container_id=str(doc.get("container_id", "")),
                ports={str(k): int(v) for k, v in (doc.get("ports") or {}).items()},
                restarts=int(doc.get("restarts", 0)),
                workdir=str(doc.get("workdir", "")),
                env={str(k): str(v) for k, v in (doc.get("env") or {}).items()},
                sandbox_uid=int(doc.get("sandbox_uid", 0)),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass(frozen=True)
class Confined:
    """How a sandboxed instance runs: what its exec health checks join, and with which environment."""

    sandbox: Sandbox
    confinement: Confinement
    env: Mapping[str, str]


@dataclass(eq=False)
class ProcessHandle:
    """A running instance process: one this agent spawned, or one adopted from a previous agent run."""

    oom_killed = False
    """Never known for a bare process (a SIGKILL only makes an OOM kill likely)."""

    pid: int
    create_time: float
    _: KW_ONLY
    child: asyncio.subprocess.Process | None = None
    """The process as spawned by this agent run; None: adopted (polled every ``poll_interval``)."""
    poll_interval: float = 1.0
    confined: Confined | None = None

    def __post_init__(self) -> None:
        self._ps: psutil.Process | None = None
        with contextlib.suppress(psutil.Error):
            self._ps = psutil.Process(self.pid)
        self._sandbox: psutil.Process | None = None
        """The sandbox's pid 1 (bwrap's init in its pid namespace): it exits when nothing is left inside."""
        self.remember_sandbox()

    def remember_sandbox(self) -> bool:
        """Find (once) the sandbox's pid 1 while bwrap still runs; True when known (or not sandboxed)."""
        if self.confined is None or self._sandbox is not None:
            return True
        init = sandbox_init(self.pid, self.create_time)
        if init:
            with contextlib.suppress(psutil.Error):
                self._sandbox = psutil.Process(init)
        return self._sandbox is not None

    async def find_sandbox(self, timeout: float = SANDBOX_FIND_WAIT) -> None:
        """Wait (briefly) until the sandbox's pid 1 is known, so its end can be waited for."""
        deadline = time.monotonic() + timeout
        while not self.remember_sandbox() and self.alive() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    def sandbox_left(self) -> bool:
        """Whether anything of the sandbox still runs (its pid 1 exits last)."""
        return self._sandbox is not None and _running(self._sandbox)

    def _kill_sandbox(self) -> None:
        """SIGKILL the sandbox's pid 1: the kernel then kills every process of its pid namespace."""
        if self._sandbox is not None:
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                self._sandbox.send_signal(signal.SIGKILL)  # psutil checks it still is that very process

    async def _empty_sandbox(self, grace: float = SANDBOX_EXIT_GRACE) -> None:
        """After the command exited: wait ``grace`` for the sandbox to empty by itself, then kill what is
        left, and wait until it is gone."""
        if self._sandbox is None:
            return
        deadline = time.monotonic() + grace
        while self.sandbox_left() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_GROUP_POLL_INTERVAL)
        if not self.sandbox_left():
            return
        self._kill_sandbox()
        deadline = time.monotonic() + SANDBOX_KILL_WAIT
        while self.sandbox_left() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_GROUP_POLL_INTERVAL)

    @property
    def sandbox_uid(self) -> int:
        return self.confined.confinement.uid if self.confined is not None else 0

    @property
    def exec_check(self) -> Callable[[str], Awaitable[bool]] | None:
        """A sandboxed instance's exec health checks run inside its sandbox, as its user; a bare process's on
        the host, in the instance's directory (``health.check_exec``)."""
        return self._check_inside if self.confined is not None else None

    async def _check_inside(self, command: str) -> bool:
        confined = self.confined
        assert confined is not None
        init = sandbox_init(self.pid, self.create_time)
        if not init:
            return False
        c = confined.confinement
        wrapped = confined.sandbox.enter(init, c.uid, c.workdir, command)
        try:
            if sandbox_init(self.pid, self.create_time) != init:  # the namespaces opened are not this instance's
                return False
            proc = await asyncio.create_subprocess_exec(
                *wrapped.argv,
                env=confined.sandbox.environment(c, confined.env),
                pass_fds=wrapped.fds,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            wrapped.close()
        try:
            return await proc.wait() == 0
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise

    @property
    def container_id(self) -> str:
        """Identifies this process instance (a new one after every restart), as a container id would."""
        return f"proc-{self.pid}-{int(self.create_time * 1000)}"

    def usage(self) -> tuple[float, int] | None:
        """None: the heartbeat samples the process tree itself (psutil)."""
        return None

    @property
    def adopted(self) -> bool:
        return self.child is None

    def alive(self) -> bool:
        if self.child is not None:
            return self.child.returncode is None
        return self._ps is not None and _running(self._ps)

    async def wait(self) -> int | None:
        """The exit code; None for an adopted process (not our child: its exit status is not ours to read)."""
        if self.child is not None:
            code = await self.child.wait()
            if self.confined is None:
                return code
            await self._empty_sandbox()
            return exit_status(code)
        # Not our child: no exit notification exists, so poll.
        while self.alive():  # noqa: ASYNC110
            await asyncio.sleep(self.poll_interval)
        await self._empty_sandbox()
        return None

    def signal(self, sig: int) -> None:
        """Signal the whole process group (the instance is its session leader), or the pid alone; in a
        sandbox, every process inside it."""
        if self.confined is not None and sig != signal.SIGKILL:
            signal_inside(self.pid, sig)
            return
        if sig == signal.SIGKILL:
            self._kill_sandbox()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def kill_leftovers(self) -> None:
        """After the leader exited: kill what it left in its group (a stray child would hold the port), and
        in its sandbox (processes of their own session, which the group's SIGKILL does not reach)."""
        self._kill_sandbox()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def _members(self) -> list[psutil.Process]:
        """The process and its descendants now (the group's other members, as far as they can be found)."""
        if self._ps is None:
            return []
        try:
            return [self._ps, *self._ps.children(recursive=True)]
        except psutil.Error:
            return [self._ps]

    async def stop(self, grace: float) -> int | None:
        """SIGTERM to the group, SIGKILL after ``grace`` seconds; returns the leader's exit code when known.

        The whole group gets the grace, not just the leader: a ``sh -c`` leader dies at once on SIGTERM while
        the app it started is still shutting down cleanly.
        """
        deadline = time.monotonic() + grace
        members = self._members()
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(self.wait(), grace)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                code = await self.wait()
        else:
            code = await self.wait()
        # The descendants are not our children: no exit notification exists, so poll.
        while time.monotonic() < deadline and any(_running(m) for m in members[1:]):  # noqa: ASYNC110
            await asyncio.sleep(_GROUP_POLL_INTERVAL)
        self.kill_leftovers()
        return code


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def adopt(record: InstanceRecord, *, poll_interval: float, confined: Confined | None = None) -> ProcessHandle | None:
    """The recorded process if it still runs (same pid AND same creation time), else None."""
    if record.pid <= 0:
        return None
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) > _CREATE_TIME_TOLERANCE:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return ProcessHandle(record.pid, record.create_time, poll_interval=poll_interval, confined=confined)


async def spawn(
    command: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    instance_dir: Path,
    sandbox: Sandbox | None = None,
    confinement: Confinement | None = None,
) -> ProcessHandle:
    """Start ``command`` in its own session, its stdout and stderr appended to the instance's output files;
    with a ``sandbox``, confined as ``confinement`` says."""
    wrapped = sandbox.wrap(confinement, command, env) if sandbox is not None and confinement is not None else None
    sinks = open_output_files(instance_dir)
    try:
        child = await asyncio.create_subprocess_exec(
            *(wrapped.argv if wrapped is not None else command),
            cwd=cwd,
            env=wrapped.env if wrapped is not None else dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=sinks[STDOUT],
            stderr=sinks[STDERR],
            start_new_session=True,
            pass_fds=wrapped.fds if wrapped is not None else (),
        )
    finally:
        for fd in sinks.values():
            os.close(fd)
        if wrapped is not None:
            wrapped.close()
    try:
        create_time = psutil.Process(child.pid).create_time()
    except psutil.Error:
        create_time = 0.0  # it already exited; wait() reports how
    confined = None
    if sandbox is not None and confinement is not None:
        confined = Confined(sandbox, confinement, dict(env))
    handle = ProcessHandle(child.pid, create_time, child=child, confined=confined)
    await handle.find_sandbox()
    return handle


class PortAllocator:
    """Free host ports for instances, never the same one twice while it is held."""

    def __init__(self) -> None:
        self._held: set[int] = set()

    def hold(self, ports: Mapping[str, int]) -> None:
        self._held.update(ports.values())

    def release(self, ports: Mapping[str, int]) -> None:
        self._held.difference_update(ports.values())

    def allocate(self) -> int:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                port = int(sock.getsockname()[1])
            if port not in self._held:
                self._held.add(port)
                return port
