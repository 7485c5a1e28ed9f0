"""Idle footprint of ``zattera up`` on one machine: the control plane in one process (the default) next to
one process per service (``--separate``), both started at once in the same run.

Run: ``python -m benchmarks.footprint_bench [--full] [--json]`` (also part of ``make bench``).

Each mode is a real ``zattera up`` (embedded NATS, the control plane, the local agent and proxy) on its own
data dir and free ports, with metrics off and no app deployed. Once every control-plane process logs
``running`` and a settling time has passed, every process of its tree is measured: resident memory (RSS)
and CPU time used over a window (quick: settle 3 s, window 4 s; full: 20 s and 60 s), grouped as the
supervisor (``zattera up`` itself), the control-plane services, the node (agent and proxy) and nats-server.

Target: the control plane of a single machine (supervisor + services) ≤ 150 MB at idle (issue 22).
Anchor: k3s and Nomad ship their control plane as one binary; before all-in-one, ``zattera up`` held nine
Python processes and 475 MB.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.common import Row, bench_main, row, stop_up
from shared.embedded import free_port
from tests.e2e.cluster import ROOT, cli_argv

MODES = {"all-in-one": "--all-in-one", "separate": "--separate"}
GROUPS = ("supervisor", "control plane", "node", "nats-server")
NODE_MODULES = ("services.agent", "services.proxy", "haproxy")  # HAProxy: the proxy's data plane


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
        result[run.mode] = {g: (float(v[0]), float(v[1]), int(v[2])) for g, v in groups.items()}
    return result


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
        rows.append(
            row(
                f"idle CPU, control plane (supervisor + services), {mode}",
                cpu["supervisor"] + cpu["control plane"],
                "% of a core",
            )
        )
        rows.append(row(f"idle CPU, whole `zattera up`, {mode}", sum(cpu.values()), "% of a core"))
    return rows


if __name__ == "__main__":
    bench_main("Footprint of zattera up at idle", run, __doc__, "settle 20 s, CPU window 60 s")
