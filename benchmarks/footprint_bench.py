"""Idle footprint of ``zattera up`` on one machine: the control plane in one process (the default) next to
one process per service (``--separate``), both started at once in the same run; with ``--full``, also
compose.yaml's two shapes in containers: the all-in-one container, then one container per service (two of
each but the console).

Run: ``python -m benchmarks.footprint_bench [--full] [--json]`` (also part of ``make bench``).

Each mode is a real ``zattera up`` (embedded NATS, the control plane, the local agent and proxy) on its own
data dir and free ports, with metrics off and no app deployed. Once every control-plane process logs
``running`` and a settling time has passed, every process of its tree is measured: resident memory (RSS)
and CPU time used over a window (quick: settle 3 s, window 4 s; full: 20 s and 60 s), grouped as the
supervisor (``zattera up`` itself), the control-plane services, the node (agent and proxy) and nats-server.

The compose shapes (full only: on the tests' ``vfs`` daemon, creating 20 containers takes minutes) run on a
private dockerd (``tests/dockerd.py``), one compose project (``tests/e2e/compose.py``: NATS, the agent and
the proxy, then each shape's control plane in turn, the other stopped), health checks at compose.yaml's
default 30 s, no app deployed. Once every container is healthy and the settling time has passed, each
container is measured: RSS of its processes, its memory as the limit counts it (cgroup usage less inactive
page cache), CPU over the window; and the Docker daemon's side (dockerd, containerd, the shims: where every
health check's ``docker exec`` is paid).

Target: the control plane of a single machine (supervisor + services) ≤ 150 MB at idle (issue 22).
Anchor: k3s and Nomad ship their control plane as one binary; before all-in-one, ``zattera up`` held nine
Python processes and 475 MB.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.common import Row, bench_main, row, stop_up
from shared.embedded import free_port
from tests.dockerd import private_dockerd
from tests.e2e.cluster import ROOT, cli_argv
from tests.e2e.compose import COMMON, SHAPES, Stack, composed

MODES = {"all-in-one": "--all-in-one", "separate": "--separate"}
NODE_TARGET = 120.0
"""MB, agent + proxy + HAProxy at idle (issue 42)."""
GROUPS = ("supervisor", "control plane", "node", "nats-server")
NODE_MODULES = ("services.agent", "services.proxy", "haproxy")  # HAProxy: the proxy's data plane
NODE_PARTS = dict(zip(NODE_MODULES, ("agent", "proxy", "HAProxy"), strict=True))


def group_of(proc: psutil.Process, supervisor_pid: int) -> str:
    if proc.pid == supervisor_pid:
        return "supervisor"
    cmdline = " ".join(proc.cmdline())
    if "nats-server" in cmdline:
        return "nats-server"
    if any(module in cmdline for module in NODE_MODULES):
        return "node"
    return "control plane"


@dataclass
class UpRun:
    """One ``zattera up`` in its own process group."""

    mode: str
    data_dir: Path
    proc: subprocess.Popen[bytes] = field(init=False)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_")}
        # Every port its own: both modes start at once, and two `zattera up`s that each find the default
        # console or HTTPS port free would both take it (the loser restarting in a loop).
        env |= {"PYTHONUNBUFFERED": "1", "OTEL_TRACES_EXPORTER": "none", "ZATTERA_CONSOLE_PORT": str(free_port())}
        argv = [*cli_argv(), "up", MODES[self.mode], "--data-dir", str(self.data_dir)]
        argv += ["--port", str(free_port()), "--proxy-port", str(free_port()), "--metrics-port", "0"]
        argv += ["--proxy-tls-listen", f"0.0.0.0:{free_port()}"]
        with open(self.data_dir.parent / f"{self.mode}.out", "wb") as sink:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )

    def control_plane_logs(self) -> list[Path]:
        names = ("control-plane",) if self.mode == "all-in-one" else ("scheduler", "orchestrator", "routes")
        return [self.data_dir / "logs" / f"{name}.log" for name in names]

    def ready(self) -> bool:
        logs = self.control_plane_logs()
        return all(p.exists() and "running" in p.read_text(errors="replace") for p in logs)

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> None:
        stop_up(self.proc, self.data_dir)


def cpu_seconds(procs: list[psutil.Process]) -> dict[int, float]:
    used = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            used[proc.pid] = times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            continue
    return used


def measure(runs: list[UpRun], window: float) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per mode and group: (RSS MB, CPU % of one core over ``window``, processes)."""
    trees = {run.mode: run.tree() for run in runs}
    before = {mode: cpu_seconds(procs) for mode, procs in trees.items()}
    time.sleep(window)
    result: dict[str, dict[str, tuple[float, float, int]]] = {}
    for run in runs:
        after = cpu_seconds(trees[run.mode])
        groups = {g: [0.0, 0.0, 0] for g in GROUPS}
        for proc in trees[run.mode]:
            try:
                rss = proc.memory_info().rss / 2**20
                group = group_of(proc, run.proc.pid)
            except psutil.Error:
                continue
            used = after.get(proc.pid, 0.0) - before[run.mode].get(proc.pid, 0.0)
            entry = groups[group]
            entry[0] += rss
            entry[1] += 100.0 * used / window
            entry[2] = int(entry[2]) + 1
            if group == "node":  # where the node's MB go: each of its programs, and its PSS (shared pages split)
                with contextlib.suppress(psutil.Error, OSError):
                    cmdline = " ".join(proc.cmdline())
                    part = next(NODE_PARTS[m] for m in NODE_MODULES if m in cmdline)
                    if part == "HAProxy":  # its master (the proxy's child) and its worker (the master's)
                        parent = proc.parent()
                        part += " worker" if parent is not None and "haproxy" in parent.name() else " master"
                    groups.setdefault(f"node: {part}", [0.0, 0.0, 0])[0] += rss
                    groups.setdefault("node PSS", [0.0, 0.0, 0])[0] += proc.memory_full_info().pss / 2**20
                    for name, mb in rollup(proc.pid).items():
                        groups.setdefault(f"node: {part}: {name}", [0.0, 0.0, 0])[0] += mb
        result[run.mode] = {g: (float(v[0]), float(v[1]), int(v[2])) for g, v in groups.items()}
    return result


def rollup(pid: int) -> dict[str, float]:
    """MB of a process's memory by kind (``/proc/<pid>/smaps_rollup``): PSS, USS (its own pages: private clean +
    dirty), anonymous (heap, the interpreter's objects and code) and file-backed (the binary, shared libraries,
    extension modules: shared with every process that maps them) resident pages."""
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            kb[name] = int(value.split()[0])
    return {
        "PSS": kb.get("Pss", 0) / 1024,
        "USS": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) / 1024,
        "anonymous": kb.get("Anonymous", 0) / 1024,
        "file-backed": (kb.get("Rss", 0) - kb.get("Anonymous", 0)) / 1024,
    }


IMPORT_STEPS = (
    ("asyncio and ssl", "import asyncio, ssl"),
    ("nats-py (without aiohttp: shared/lean.py)", "from shared.lean import import_nats; import_nats()"),
    (
        "protobuf and the generated messages",
        "import google.protobuf.message, zattera.v1.types_pb2, zattera.cluster.v1.cluster_pb2",
    ),
    ("pydantic and pydantic-settings (every setting)", "import pydantic_settings, shared.settings"),
)
IMPORT_PROBE = """
import json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
steps = json.loads(sys.argv[1])
sizes = [("the interpreter", rss())]
for label, code in steps:
    before = rss()
    exec(code)
    sizes.append((label, rss() - before))
print(json.dumps(sizes))
"""


def import_breakdown(module: str) -> list[tuple[str, float]]:
    """Where a node process's MB go before it runs: RSS of a fresh interpreter, then what each step of its
    imports adds, in the order the process loads them (the last: its own modules and the small libraries they
    use); each step pays for what it loads first."""
    steps = [*IMPORT_STEPS, (f"{module}: its own code and the rest", f"import {module}.__main__")]
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, json.dumps(steps)], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return [(label, float(mb)) for label, mb in json.loads(out)]


@dataclass
class Measured:
    """One container (or the daemon's side) at idle."""

    service: str
    rss: float
    """MB, its processes' resident memory."""
    cgroup: float
    """MB, its memory as its limit counts it."""
    cpu: float
    """Percent of one core over the window."""


def daemon_side(docker_root: Path) -> list[psutil.Process]:
    """dockerd, containerd and the shims of the daemon under ``docker_root``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(docker_root) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


async def measure_shape(stack: Stack, shape: str, docker_root: Path, settle: float, window: float) -> list[Measured]:
    """The shape up beside NATS, the agent and the proxy, every container healthy, settled: each container
    measured over ``window`` (and the daemon's side, service ``docker``)."""
    async with stack.shape(shape) as services:
        await asyncio.sleep(settle)
        trees: dict[str, list[psutil.Process]] = {}
        ids: dict[str, tuple[str, str]] = {}
        for service in (*COMMON, *services):
            for container in await stack.containers(service):
                root = psutil.Process(container["State"]["Pid"])
                trees[container["Id"]] = [root, *root.children(recursive=True)]
                ids[container["Id"]] = (service, container["Id"])
        trees["docker"] = daemon_side(docker_root)
        before = {key: cpu_seconds(procs) for key, procs in trees.items()}
        await asyncio.sleep(window)
        measured = []
        for key, procs in trees.items():
            after = cpu_seconds(procs)
            used = sum(after.get(pid, 0.0) - before[key].get(pid, 0.0) for pid in after)
            rss = 0.0
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    rss += proc.memory_info().rss / 2**20
            service, container_id = ids.get(key, ("docker", ""))
            cgroup = await stack.memory(container_id) if container_id else 0.0
            measured.append(Measured(service, rss, cgroup, 100.0 * used / window))
    return measured


def compose_rows(settle: float, window: float) -> list[Row]:
    root = Path(tempfile.mkdtemp(prefix="zattera-footprint-compose-"))
    try:
        with private_dockerd(root / "dockerd") as docker_host, composed(docker_host) as stack:
            figures = {
                shape: asyncio.run(measure_shape(stack, shape, root / "dockerd", settle, window)) for shape in SHAPES
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for shape, measured in figures.items():
        control = [m for m in measured if m.service in SHAPES[shape]]
        stack_rss = sum(m.rss for m in measured if m.service != "docker")
        label = f"{len(control)} container{'s' * (len(control) != 1)}"
        rows.append(row(f"compose idle RSS, control plane ({label}), {shape}", sum(m.rss for m in control), "MB"))
        rows.append(
            row(
                f"compose idle memory as limited (cgroup), control plane ({label}), {shape}",
                sum(m.cgroup for m in control),
                "MB",
            )
        )
        for service in SHAPES[shape]:
            mine = [m for m in control if m.service == service]
            rows.append(
                row(
                    f"compose idle RSS per container, {service} (x{len(mine)}), {shape}",
                    sum(m.rss for m in mine) / len(mine),
                    "MB",
                    "",
                    f"cgroup {sum(m.cgroup for m in mine) / len(mine):.0f} MB",
                )
            )
        for service in COMMON:
            [mine] = [m for m in measured if m.service == service]
            rows.append(row(f"compose idle RSS, {service} container, {shape}", mine.rss, "MB"))
        rows.append(row(f"compose idle RSS, whole stack (control plane, nats, agent, proxy), {shape}", stack_rss, "MB"))
        rows.append(row(f"compose idle CPU, control plane, {shape}", sum(m.cpu for m in control), "% of a core"))
        rows.append(
            row(
                f"compose idle CPU, whole stack, {shape}",
                sum(m.cpu for m in measured if m.service != "docker"),
                "% of a core",
            )
        )
        [docker] = [m for m in measured if m.service == "docker"]
        rows.append(
            row(
                f"compose idle CPU, Docker daemon side (health checks every 30 s), {shape}",
                docker.cpu,
                "% of a core",
            )
        )
    return rows


def node_rows(groups: dict[str, tuple[float, float, int]], node: float) -> list[Row]:
    """The node (agent + proxy + HAProxy) against its target, then where each MB goes: each process's RSS,
    PSS, USS, anonymous and file-backed pages, and what the Python processes' imports take."""
    over = node - NODE_TARGET
    verdict = f"{'over' if over > 0 else 'under'} the target by {abs(over):.1f} MB"
    rows = [row("idle RSS, node (agent + proxy + HAProxy)", node, "MB", f"≤ {NODE_TARGET:.0f} MB", verdict)]
    for part in ("agent", "proxy", "HAProxy master", "HAProxy worker"):
        rss = groups.get(f"node: {part}", (0.0,))[0]
        kinds = {k: groups.get(f"node: {part}: {k}", (0.0,))[0] for k in ("PSS", "USS", "anonymous", "file-backed")}
        detail = ", ".join(f"{k} {v:.1f}" for k, v in kinds.items())
        rows.append(row(f"idle RSS, node: {part}", rss, "MB", "", detail))
    pss = groups.get("node PSS", (0.0,))[0]
    rows.append(row("idle PSS, node (pages shared with other processes split among them)", pss, "MB"))
    for part, module in (("agent", "services.agent"), ("proxy", "services.proxy")):
        steps = import_breakdown(module)
        imported = sum(mb for _, mb in steps)
        for label, mb in steps:
            rows.append(row(f"where the {part}'s MB go: {label}", mb, "MB"))
        running = groups.get(f"node: {part}", (0.0,))[0] - imported
        rows.append(row(f"where the {part}'s MB go: running (live objects, buffers, threads)", running, "MB"))
    return rows


def run(quick: bool = True) -> list[Row]:
    settle, window = (3.0, 4.0) if quick else (20.0, 60.0)
    with tempfile.TemporaryDirectory(prefix="zattera-footprint-") as tmp:
        runs = [UpRun(mode, Path(tmp) / mode / "data") for mode in MODES]
        try:
            for up in runs:
                up.data_dir.parent.mkdir(parents=True)
                up.start()
            deadline = time.monotonic() + 120
            while not all(up.ready() for up in runs):
                if time.monotonic() > deadline or any(up.proc.poll() is not None for up in runs):
                    outputs = "\n".join((Path(tmp) / f"{up.mode}.out").read_text() for up in runs)
                    raise RuntimeError(f"zattera up did not come up:\n{outputs}")
                time.sleep(0.2)
            time.sleep(settle)
            figures = measure(runs, window)
        finally:
            for up in runs:
                up.stop()
    rows = []
    for mode, groups in figures.items():
        rss = {g: groups[g][0] for g in GROUPS}
        cpu = {g: groups[g][1] for g in GROUPS}
        count = groups["control plane"][2]
        control = rss["supervisor"] + rss["control plane"]
        rows.append(
            row(
                f"idle RSS, control plane (supervisor + {count} service process{'es' * (count != 1)}), {mode}",
                control,
                "MB",
                "≤ 150 MB" if mode == "all-in-one" else "",
                "k3s, Nomad: one binary" if mode == "all-in-one" else "the shape before issue 22",
            )
        )
        for group in ("supervisor", "control plane", "node", "nats-server"):
            label = "control-plane services" if group == "control plane" else group
            rows.append(row(f"idle RSS, {label}, {mode}", rss[group], "MB"))
        rows.append(row(f"idle RSS, whole `zattera up`, {mode}", sum(rss.values()), "MB", "", "issue 22: 475 MB"))
        if mode == "all-in-one":
            rows += node_rows(groups, rss["node"])
        rows.append(
            row(
                f"idle CPU, control plane (supervisor + services), {mode}",
                cpu["supervisor"] + cpu["control plane"],
                "% of a core",
            )
        )
        rows.append(row(f"idle CPU, whole `zattera up`, {mode}", sum(cpu.values()), "% of a core"))
    if not quick:
        rows += compose_rows(settle, window)
    return rows


if __name__ == "__main__":
    bench_main("Footprint of zattera up at idle", run, __doc__, "settle 20 s, CPU window 60 s, and both compose shapes")
