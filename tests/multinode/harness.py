"""Machines in network namespaces: one namespace per machine, a veth from each onto a bridge this harness
creates, addresses it assigns (10.231.0.0/24, only inside), and in each namespace the real processes the
machine runs (``zattera up`` under ``ip netns exec``, with a ``/run/wireguard`` of its own). Everything it
made — processes, namespaces, the bridge — is removed at the end, on failure too.

Needs root and ``ip netns``; :func:`unavailable` says why not. In CI (``CI=true``) that is a failure, else a
skip with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ZATTERA = str(Path(sys.executable).parent / "zattera")
SUBNET = "10.231.0"


def unavailable() -> str:
    """Why machines in namespaces cannot run here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"zt-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class Machine:
    name: str
    netns: str
    address: str
    veth: str
    data_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def exec(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a command inside this machine's namespace."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns, *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            cwd=PROJECT_ROOT,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"[{self.name}] {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def zattera(
        self, *args: str, env: dict[str, str] | None = None, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """The ``zattera`` CLI inside this machine."""
        command = ["ip", "netns", "exec", self.netns, ZATTERA, *args]
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=check,
            cwd=PROJECT_ROOT,
            env={**os.environ, **(env or {})},
            timeout=60,
        )

    def start(self, *args: str, log: str = "up.log") -> subprocess.Popen[bytes]:
        """Start ``zattera up ARGS`` in this machine (its own process group, output to ``data_dir/log``)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        out = (self.data_dir / log).open("ab")
        # A machine has its own /run: userspace WireGuard's control socket (/run/wireguard/<interface>.sock, a
        # fixed path that wireguard-go and wg share) is the machine's, not every namespace's on this host.
        run_wireguard = self.data_dir / "run-wireguard"
        run_wireguard.mkdir(exist_ok=True)
        own_run = 'mkdir -p /run/wireguard && mount --bind "$0" /run/wireguard && exec "$@"'
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                *("unshare", "--mount", "--propagation", "private", "sh", "-c", own_run, str(run_wireguard)),
                ZATTERA,
                "up",
                "--data-dir",
                str(self.data_dir),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
            env={**os.environ, "ZATTERA_AGENT_DNS_PORT": "0", "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process running in this machine's namespace."""
        done = _run("ip", "netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split()]

    def kill_all(self) -> None:
        """SIGKILL every process of the machine (a machine lost at once)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(5)
        self.procs.clear()

    def stop(self, grace: float = 20.0) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()
        self.kill_all()

    def tail(self, lines: int = 25) -> str:
        """The end of what ``zattera up`` printed on this machine and its services' errors and warnings."""
        parts = []
        for path in sorted([self.data_dir / "up.log", *self.data_dir.glob("logs/*.log")]):
            if not path.is_file():
                continue
            text = path.read_text(errors="replace").splitlines()
            problems = [t for t in text if " ERROR " in t or " WARNING " in t]
            shown = text[-lines:] if path.name == "up.log" else problems[-8:]
            parts.append(f"--- [{self.name}] {path.name}\n" + "\n".join(shown))
        return "\n".join(parts)

    def link(self, up: bool) -> None:
        """Cut (or restore) the machine's link to the bridge."""
        _run("ip", "link", "set", self.veth, "up" if up else "down")


class Network:
    """The bridge and the machines on it."""

    def __init__(self, base: Path) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"ztb{self.tag}"
        self.base = base
        self.machines: dict[str, Machine] = {}
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")

    def add(self, name: str) -> Machine:
        index = len(self.machines) + 1
        netns = f"zt{self.tag}-{name}"
        host_end, inner = f"zv{self.tag}{index}", f"zi{self.tag}{index}"
        _run("ip", "netns", "add", netns)
        machine = Machine(name, netns, f"{SUBNET}.{index + 10}", host_end, self.base / name)
        self.machines[name] = machine
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", netns)
        _run("ip", "link", "set", host_end, "master", self.bridge)
        _run("ip", "link", "set", host_end, "up")
        machine.exec("ip", "link", "set", "lo", "up")
        machine.exec("ip", "link", "set", inner, "name", "eth0")
        machine.exec("ip", "addr", "add", f"{machine.address}/24", "dev", "eth0")
        machine.exec("ip", "link", "set", "eth0", "up")
        return machine

    def close(self) -> None:
        for machine in self.machines.values():
            print(machine.tail())  # shown by pytest when the test failed (captured otherwise)
            with contextlib.suppress(Exception):
                machine.stop(grace=10)
            _run("ip", "netns", "del", machine.netns, check=False)
            _run("ip", "link", "del", machine.veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
