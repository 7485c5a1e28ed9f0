"""The process runtime's sandbox: instances, jobs, exec health checks and build steps of a node run in
bubblewrap namespaces, each environment as a user of its own (SECURITY.md, "Apps").

How one sandboxed process starts (:meth:`Sandbox.wrap`):

* ``bwrap`` runs as root (the agent's user) and builds new mount, pid, IPC, UTS and cgroup namespaces. The
  mount namespace shows a tmpfs root with the system read-only (``/usr``, ``/etc`` and the merged-usr links
  or directories, the node's Python installation, :attr:`Sandbox.read_only` extras), a fresh ``/dev``, a
  ``/proc`` of the new pid namespace (no other process of the machine is visible), a private ``/tmp`` and
  ``/dev/shm``, and read-write exactly the paths the caller names (an instance's directory and volumes, a
  build's scratch directory and caches), each at its own path. Nothing else of the host exists: not the
  agent's data directory, not the control plane's, no Docker socket, no ``/run``, ``/var`` or ``/home``.
  All mounts are ``nosuid,nodev``. Because bwrap mounts as root, the sources can stay inside the root-only
  (0700) data directory: the sandbox's user can never traverse it, not even by a path.
* Inside, ``setpriv`` (util-linux) switches to the environment's uid and gid (:class:`UidTable`), clears
  the supplementary groups, empties the bounding, inheritable and ambient capability sets and sets
  ``PR_SET_NO_NEW_PRIVS``, then execs the command: nothing the app runs ever holds a capability or root.
  ``/etc/passwd`` and ``/etc/group`` inside list that user (``zattera-<uid>``).
* The network namespace stays the host's: instances listen on the node's address at the ports the agent
  gives them, reach the private-network forwarder and ``*.internal`` resolver as before.

Process tree: agent → ``bwrap`` (the handle's pid, in a session of its own) → ``bwrap`` as pid 1 of the
namespace (reaps orphans) → the command. When that pid 1 exits, the kernel kills whatever is left in the
namespace, so an instance leaves no stray process. Signals go to the processes *inside* (the outer bwrap
has no handler and would die at once, losing the exit status): :func:`signal_inside`. The outer bwrap
reports the command's exit code, or ``128 + signal`` (:func:`exit_status`).

Exec health checks join a running instance's namespaces (``nsenter``) and drop to its user the same way
(:meth:`Sandbox.enter`); snapshot pre-hooks run in a sandbox of their own with only their volume
(:func:`hook_runner`).

Which machines can sandbox (:func:`probe`): the agent runs as root (it switches to other users), ``bwrap``,
``setpriv`` and ``nsenter`` are installed, and a trial sandbox starts. No user namespace is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from services.agent.sandbox_users import UidTable, give
from services.agent.snapshots.handlers import HOOK_TIMEOUT, HookRunner, PreHookError
from shared.errors import ZatteraError

log = logging.getLogger(__name__)

SANDBOX = "sandbox"
"""``Node.isolation`` of a process-runtime node that sandboxes its instances."""
CONTAINER = "container"
"""``Node.isolation`` of a docker-runtime node."""
NONE = "none"
"""``Node.isolation`` of a process-runtime node that runs instances as the agent's own user."""

SETPRIV = "/usr/bin/setpriv"
"""Inside the sandbox (from the read-only ``/usr``)."""
SYSTEM_DIRECTORIES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""Shown read-only in every sandbox (a merged-usr link is re-created as the same link)."""
PROBE_TIMEOUT = 15.0
_CHECK_SCRIPT = 'cd "$1" && exec /bin/sh -c "$2"'
_SIGNAL_EXIT_BASE = 128


class SandboxError(ZatteraError):
    """A sandboxed process cannot be started (the sandbox itself failed, not the command)."""


class IsolationRefused(ZatteraError):
    """This node would run apps without isolation where that is not allowed (a secured cluster)."""


@dataclass(frozen=True)
class Support:
    """What this machine offers for sandboxes: the tools' paths, or why it cannot sandbox (``problem``)."""

    bwrap: str = ""
    nsenter: str = ""
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


def _tools(bwrap: str) -> tuple[Support, list[str]]:
    """The tools found, and the probe command (empty when a precondition already fails)."""
    if os.geteuid() != 0:
        return Support(problem="the agent does not run as root (a user per environment needs root)"), []
    found = shutil.which(bwrap or "bwrap")
    if not found:
        return Support(problem="bubblewrap is not installed (Debian: apt-get install bubblewrap)"), []
    nsenter = shutil.which("nsenter")
    if not nsenter or not os.access(SETPRIV, os.X_OK):
        return Support(problem="util-linux's setpriv and nsenter are not installed"), []
    argv = [found, "--unshare-pid", "--unshare-ipc", *_system_arguments(()), "--proc", "/proc", "--dev", "/dev"]
    return Support(bwrap=found, nsenter=nsenter), [*argv, "--", SETPRIV, *_drop(_PROBE_UID), "--", "/bin/true"]


_PROBE_UID = 65534


def _verdict(support: Support, code: int, stderr: bytes) -> Support:
    if code == 0:
        return support
    said = stderr.decode(errors="replace").strip().splitlines()
    why = said[-1] if said else f"exit status {code}"
    return Support(problem=f"bubblewrap cannot make a sandbox here: {why}")


def probe_now(bwrap: str = "") -> Support:
    """Whether this machine can sandbox instances (a trial sandbox runs ``/bin/true``); blocking."""
    support, argv = _tools(bwrap)
    if not argv:
        return support
    try:
        done = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT, check=False, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Support(problem=f"bubblewrap cannot make a sandbox here: {exc}")
    return _verdict(support, done.returncode, done.stderr)


async def probe(bwrap: str = "") -> Support:
    """:func:`probe_now` without blocking the event loop."""
    support, argv = _tools(bwrap)
    if not argv:
        return support
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/"
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        return Support(problem=f"bubblewrap cannot make a sandbox here: {exc!r}")
    return _verdict(support, proc.returncode or 0, stderr)


@dataclass(frozen=True)
class Isolation:
    """How this node runs instances: ``kind`` (``Node.isolation``) and, for ``none``, why; for ``sandbox`` and
    ``container``, why apps are not fenced from the control plane's ports (``firewall.py``), if they are not."""

    kind: str
    problem: str = ""

    def describe(self) -> str:
        if self.kind == SANDBOX:
            said = "sandboxed (bubblewrap namespaces, a user per environment, no capabilities"
            if self.problem:  # the network fence (firewall.py) is missing
                return f"{said}), but NOT fenced from the control plane's ports: {self.problem}"
            return f"{said}, fenced from the control plane's ports)"
        if self.kind == CONTAINER:
            said = "containers (docker runtime, a user per environment, no capabilities"
            if self.problem:  # the network fence (firewall.py) is missing
                return f"{said}), but NOT fenced from the control plane's ports: {self.problem}"
            return f"{said}, fenced from the control plane's ports)"
        return f"NOT isolated: {self.problem}"


def decide_isolation(
    *, runtime: str, mode: str, support: Support, secured: bool, allow_unisolated: bool, what: str = "apps"
) -> Isolation:
    """How ``what`` (apps, or a docker node's builds) run on this node, or :class:`IsolationRefused`.

    ``mode`` (``ZATTERA_AGENT_SANDBOX``): ``auto`` sandboxes when the machine can, ``on`` requires it, ``off``
    never sandboxes. Running unisolated is refused when ``on``, and on a secured cluster unless
    ``allow_unisolated`` (the operator's documented override): there, an app could read the node's credential
    and every other app's files and environment.
    """
    if runtime == "docker":
        return Isolation(CONTAINER)
    if mode != "off" and support.ok:
        return Isolation(SANDBOX)
    problem = "turned off (ZATTERA_AGENT_SANDBOX=off)" if mode == "off" else support.problem
    if mode == "on":
        raise IsolationRefused(f"this machine cannot sandbox {what}: {problem} (ZATTERA_AGENT_SANDBOX=on)")
    if secured and not allow_unisolated:
        raise IsolationRefused(
            f"{what} would run without isolation ({problem}): on a secured cluster an app could then read this"
            " node's credential and other apps' files; install bubblewrap and run the agent as root, or pass"
            " --allow-unisolated-apps (ZATTERA_AGENT_ALLOW_UNISOLATED=1) to accept that (SECURITY.md)"
        )
    return Isolation(NONE, problem)


# ---------------------------------------------------------------------------------------------- sandboxes


@dataclass(frozen=True)
class Confinement:
    """What one sandboxed process may use: run as ``uid`` in ``workdir``, write ``writable``."""

    uid: int
    workdir: Path
    writable: tuple[Path, ...]
    home: Path | None = None
    """``HOME`` inside; None: the working directory."""
    die_with_parent: bool = False
    """Build steps: killed when the agent dies. Instances outlive it (a restarted agent adopts them)."""


@dataclass
class Wrapped:
    """A command made sandboxed: start ``argv`` with ``env`` and ``fds`` passed, then :meth:`close`."""

    argv: list[str]
    env: dict[str, str]
    fds: tuple[int, ...] = ()

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _drop(uid: int) -> list[str]:
    return [
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]


def _system_arguments(read_only: Sequence[str]) -> list[str]:
    """bwrap arguments showing the system read-only: the standard directories, then ``read_only`` (skipped
    when already inside a shown directory)."""
    args: list[str] = []
    shown: list[str] = []
    for top in SYSTEM_DIRECTORIES:
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
            shown.append(top)
    made: set[str] = {"/"}
    for extra in read_only:
        real = os.path.realpath(extra)
        if not os.path.isdir(real) or any(_within(real, s) for s in shown):
            continue
        args += _parents(real, made)
        args += ["--ro-bind", real, real]
        shown.append(real)
    return args


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _parents(path: str, made: set[str]) -> list[str]:
    """``--dir`` for each missing ancestor of ``path`` (0755: bwrap would make them 0700, untraversable for
    the sandbox's user)."""
    args: list[str] = []
    ancestors = list(reversed(Path(path).parents))
    for parent in (str(p) for p in ancestors):
        if parent not in made:
            made.add(parent)
            args += ["--perms", "0755", "--dir", parent]
    return args


def node_python_paths() -> list[str]:
    """The agent's Python installation and environment (builds run on it; so do the apps it builds)."""
    return list(dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)))


@dataclass
class Sandbox:
    """Starts sandboxed processes on this node; see the module docstring."""

    support: Support
    uids: UidTable
    read_only: Sequence[str] = field(default_factory=node_python_paths)
    """Shown read-only besides the system directories."""
    hidden: Sequence[Path] = ()
    """Covered with an empty tmpfs when they lie inside a shown directory (the agent's data directory)."""

    def __post_init__(self) -> None:
        self._system = _system_arguments(self.read_only)
        self._shown = [a for i, a in enumerate(self._system) if i and self._system[i - 1] == "--ro-bind"]
        self._hidden = [os.path.realpath(p) for p in self.hidden]

    def uid(self, key: str) -> int:
        return self.uids.uid(key)

    def environment(self, c: Confinement, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with the user's name, home and temporary directory where the agent's own were passed on."""
        result = dict(env)
        name = user_name(c.uid)
        for key, value in (
            ("HOME", str(c.home or c.workdir)),
            ("USER", name),
            ("LOGNAME", name),
            ("TMPDIR", "/tmp"),
        ):
            if key not in result or result[key] == os.environ.get(key):
                result[key] = value
        return result

    def wrap(self, c: Confinement, command: Sequence[str], env: Mapping[str, str]) -> Wrapped:
        """``command`` sandboxed as ``c`` says; the caller starts it and closes the result."""
        passwd, group = _identity_files(c)
        args = [self.support.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if c.die_with_parent:
            args.append("--die-with-parent")
        # /tmp first: a system directory under /tmp (an install there) stays shown, not covered by the tmpfs
        args += ["--perms", "1777", "--tmpfs", "/tmp"]
        args += self._system
        # world-readable, as on any system (bwrap's default for data files is 0600 root: the user could not
        # look itself up, and PostgreSQL's initdb refuses to run then)
        args += ["--perms", "0644", "--ro-bind-data", str(passwd), "/etc/passwd"]
        args += ["--perms", "0644", "--ro-bind-data", str(group), "/etc/group"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "1777", "--tmpfs", "/dev/shm"]
        made = {"/", "/tmp", *(a for a in self._system if a.startswith("/"))}
        writable = {os.path.realpath(p) for p in c.writable}
        # A hidden directory shown through a system directory or a writable one (a process:// image's
        # directory holding the agent's data) is covered, parents first, so deeper writable paths stay.
        shown = [*self._shown, *writable]
        covered = {h for h in self._hidden if any(_within(h, s) and h != s for s in shown)}
        for path in sorted(writable | covered, key=lambda p: (p.count("/"), p)):
            args += _parents(path, made)
            args += ["--perms", "0700", "--tmpfs", path] if path in covered else ["--bind", path, path]
            made.add(path)
        args += ["--chdir", str(c.workdir), "--", SETPRIV, *_drop(c.uid), "--", *command]
        return Wrapped(args, self.environment(c, env), (passwd, group))

    def enter(self, target_pid: int, uid: int, workdir: Path, command: str) -> Wrapped:
        """``/bin/sh -c command`` in ``workdir`` inside the sandbox whose pid 1 is ``target_pid`` (as seen from
        the host), as ``uid``, without capabilities: namespaces opened before the caller checks the target
        is still the process it expects (:func:`namespace_files`)."""
        fds = namespace_files(target_pid)
        args = [self.support.nsenter, *(f"--{ns}=/proc/self/fd/{fd}" for ns, fd in zip(_JOINED, fds, strict=True))]
        args += ["--", SETPRIV, *_drop(uid), "--", "/bin/sh", "-c", _CHECK_SCRIPT, "zattera-exec", str(workdir)]
        args.append(command)
        return Wrapped(args, {}, tuple(fds))


_JOINED = ("mount", "pid", "ipc", "uts")
_NS_FILES = {"mount": "mnt", "pid": "pid", "ipc": "ipc", "uts": "uts"}


def namespace_files(pid: int) -> list[int]:
    """Open descriptors of ``pid``'s mount, pid, IPC and UTS namespaces (they stay that namespace whatever
    happens to the pid afterwards)."""
    fds: list[int] = []
    try:
        for ns in _JOINED:
            fds.append(os.open(f"/proc/{pid}/ns/{_NS_FILES[ns]}", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise SandboxError(f"the instance's sandbox is gone: {exc}") from exc
    return fds


def user_name(uid: int) -> str:
    return f"zattera-{uid}"


def _identity_files(c: Confinement) -> tuple[int, int]:
    """Memory files with the system's passwd and group plus the sandbox's user (bwrap copies them in)."""
    name = user_name(c.uid)
    files = []
    for path, line in (
        ("/etc/passwd", f"{name}:x:{c.uid}:{c.uid}:Zattera app:{c.home or c.workdir}:/bin/sh\n"),
        ("/etc/group", f"{name}:x:{c.uid}:\n"),
    ):
        try:
            text = Path(path).read_text()
        except OSError:
            text = ""
        fd = os.memfd_create(Path(path).name, os.MFD_CLOEXEC)
        os.write(fd, (text if text.endswith("\n") or not text else text + "\n").encode() + line.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        files.append(fd)
    return files[0], files[1]


def hook_runner(sandbox: Sandbox, uid_of: Callable[[Path], int]) -> HookRunner:
    """Snapshot pre-hooks (an operator's command, run in a volume the app wrote) in a sandbox of their own, as
    the volume's environment's user (``uid_of(volume dir)``), with only that volume: as root on the host, a
    link the app planted there could lead the command anywhere."""

    async def run(command: str, assignment_id: str, directory: Path) -> None:
        uid = uid_of(directory)
        await asyncio.to_thread(give, directory, uid)
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
        env.update(ZATTERA_VOLUME_DIR=str(directory), ZATTERA_ASSIGNMENT_ID=assignment_id)
        c = Confinement(uid=uid, workdir=directory, writable=(directory,), die_with_parent=True)
        wrapped = sandbox.wrap(c, ["/bin/sh", "-c", command], env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *wrapped.argv,
                env=wrapped.env,
                pass_fds=wrapped.fds,
                cwd=directory,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            wrapped.close()
        try:
            code = exit_status(await asyncio.wait_for(proc.wait(), HOOK_TIMEOUT))
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, TimeoutError):
                raise PreHookError(f"pre-hook timed out after {HOOK_TIMEOUT:.0f}s") from None
            raise
        if code != 0:
            raise PreHookError(f"pre-hook exited {code}")

    return run


# ---------------------------------------------------------------------------------------------- running ones


def inside(pid: int) -> list[psutil.Process]:
    """The processes of the sandbox whose outer bwrap is ``pid`` (its pid 1 and everything below)."""
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def signal_inside(pid: int, sig: int) -> None:
    """Send ``sig`` to every process of the sandbox (the pid 1 ignores it, the command and its children get
    it), not to the outer bwrap, which would die of it and lose the command's exit status."""
    for proc in inside(pid):
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            proc.send_signal(sig)


def sandbox_init(pid: int, create_time: float) -> int:
    """The pid 1 of the sandbox whose outer bwrap is ``pid`` (started at ``create_time``), or 0 when it is gone
    or ``pid`` is another process now."""
    try:
        outer = psutil.Process(pid)
        if abs(outer.create_time() - create_time) > 0.05:
            return 0
        children = _children(outer)
    except psutil.Error:
        return 0
    return children[0] if children else 0


def _children(proc: psutil.Process) -> list[int]:
    """The pids of a single-threaded process's children (bwrap starts no thread): the kernel's list of its
    thread's children, one small file, where psutil would read the stat file of every process of the machine
    (looked for at every start of a sandboxed process). psutil's scan where the kernel keeps no such list."""
    if not _kernel_lists_children():
        return [child.pid for child in proc.children()]
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children", "rb") as listed:
            return [int(pid) for pid in listed.read().split()]
    except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
        return []


@functools.cache
def _kernel_lists_children() -> bool:
    """Whether the kernel lists each thread's children in ``/proc`` (built with ``CONFIG_PROC_CHILDREN``)."""
    pid = os.getpid()
    return os.path.exists(f"/proc/{pid}/task/{pid}/children")


def exit_status(code: int | None) -> int | None:
    """The command's exit code as a bare process would report it: bwrap reports a death by signal N as
    ``128 + N`` (so does a shell), here ``-N`` again."""
    if code is not None and _SIGNAL_EXIT_BASE < code < _SIGNAL_EXIT_BASE + signal.NSIG:
        return _SIGNAL_EXIT_BASE - code
    return code
