"""What the process runtime's sandbox costs: ``python -m benchmarks.isolation_bench [--full]``.

Instance start → listening, sandboxed (bubblewrap namespaces, the environment's own user: ``sandbox.py``)
versus bare (the agent's user), in alternating rounds of one run: each round starts one instance of each
kind, in alternating order, through the agent's own launcher (``ProcessLauncher.prepare`` then ``spawn``,
the path the runtime takes: image directory made and given to the user, bwrap and setpriv, the app's
start), and times the wait until its port accepts a connection. The control plane and the NATS reports
around it are bypassed (they are the same for both kinds). The app is the node's Python listening on its
``PORT`` (its interpreter start dominates a bare start).

The same for ``/bin/true`` (start → exit, bwrap's command line exactly as an instance gets it), three times
as many alternating rounds: the sandbox's fixed cost without the app's own start, whose spread (the Python
interpreter's, on a shared machine) hides tens of milliseconds. Noise-resistant figures beside the
wall-clock ones: the CPU time of the whole instance tree by the time it
listens (every process in it, from the scheduler's accounting: bwrap's two, setpriv's exec, the app; the
kernel's namespace and mount work is counted there) and the agent's own CPU time in ``spawn``.
Quick mode: 12 rounds; ``--full``: 60.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import psutil

from benchmarks.common import bench_main, listening, median, percentile, row
from services.agent.instance_env import PASSED_THROUGH_ENV
from services.agent.launchers import LaunchPlan, ProcessLauncher
from services.agent.processes import PortAllocator
from services.agent.sandbox import Confinement, Sandbox, node_python_paths, probe_now
from services.agent.sandbox_users import UidTable, give

TARGET = "≤ 50"
ANCHOR = "issue 43: ≤ 50 ms added at p50"
LISTENER = (
    "import os, socket\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((os.environ['ZATTERA_BIND_ADDR'], int(os.environ['PORT'])))\n"
    "s.listen()\n"
    "while True:\n"
    "    s.accept()[0].close()\n"
)


def _tree_cpu(pid: int) -> float:
    """CPU seconds the process ``pid`` and everything below it used so far, from the scheduler's own
    accounting (``/proc/<pid>/schedstat``, nanoseconds; psutil's figures are in 10 ms ticks)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for proc in tree:
        with contextlib.suppress(OSError, ValueError):
            total += int(Path(f"/proc/{proc.pid}/schedstat").read_text().split()[0])
    return total / 1e9


PYTHON = os.path.realpath(sys.executable)
IMAGE = "exec:" + quote(f'exec {PYTHON} -c "$LISTENER"', safe="")


async def _start_once(
    launcher: ProcessLauncher, base: Path, index: int, ports: PortAllocator
) -> tuple[float, float, float]:
    """(ms from spawn to listening, children's CPU ms, agent's CPU ms in spawn) of one instance."""
    instance_dir = base / f"i{index}"
    instance_dir.mkdir(mode=0o700)
    image = await launcher.prepare(None, IMAGE, instance_dir, platform="")  # type: ignore[arg-type]
    port = ports.allocate()
    env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
    env.update(PORT=str(port), ZATTERA_BIND_ADDR="127.0.0.1", LISTENER=LISTENER, ZATTERA_ASSIGNMENT_ID=f"i{index}")
    own_before = time.process_time()
    started = time.perf_counter()
    handle = await launcher.spawn(
        image.command(), image=image, env=env, instance_dir=instance_dir, plan=LaunchPlan(tenant="bench"), labels={}
    )
    own = time.process_time() - own_before
    try:
        await listening(port, poll=0.001)
        elapsed = time.perf_counter() - started
        cpu = _tree_cpu(handle.pid)
    finally:
        await handle.stop(5.0)
        ports.release({"p": port})
    return elapsed * 1000, cpu * 1000, own * 1000


async def _measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    support = probe_now()
    if not support.ok:
        raise RuntimeError(f"this machine cannot sandbox: {support.problem}")
    figures: dict[str, dict[str, list[float]]] = {
        kind: {"wall": [], "cpu": [], "own": []} for kind in ("sandboxed", "bare")
    }
    ports = PortAllocator()
    with tempfile.TemporaryDirectory(prefix="zattera-isolation-bench-") as tmp:
        root = Path(tmp)
        uids = UidTable(root / "sandbox", base=0x70000000, count=65536)
        kinds = {
            "sandboxed": ProcessLauncher(sandbox=Sandbox(support, uids, read_only=node_python_paths(), hidden=(root,))),
            "bare": ProcessLauncher(),
        }
        for kind in kinds:  # one start of each first, not counted (the page cache, the uid table)
            await _start_once(kinds[kind], root, -1 if kind == "bare" else -2, ports)
        for index in range(rounds):
            order = ("sandboxed", "bare") if index % 2 == 0 else ("bare", "sandboxed")
            for kind in order:
                wall, cpu, own = await _start_once(kinds[kind], root, index * 2 + order.index(kind), ports)
                figures[kind]["wall"].append(wall)
                figures[kind]["cpu"].append(cpu)
                figures[kind]["own"].append(own)
    return figures


async def _true_once(sandbox: Sandbox | None, workdir: Path) -> float:
    """ms from start to exit of ``/bin/true``: the sandbox's fixed cost without the app's own start."""
    command = ["/bin/true"]
    wrapped = None
    if sandbox is not None:
        confinement = Confinement(uid=sandbox.uid("env:bench"), workdir=workdir, writable=(workdir,))
        wrapped = sandbox.wrap(confinement, command, {"PATH": "/usr/bin:/bin"})
    started = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            *(wrapped.argv if wrapped else command),
            env=wrapped.env if wrapped else {"PATH": "/usr/bin:/bin"},
            pass_fds=wrapped.fds if wrapped else (),
            cwd=workdir,
            start_new_session=True,
        )
    finally:
        if wrapped is not None:
            wrapped.close()
    code = await proc.wait()
    if code != 0:
        raise RuntimeError(f"/bin/true exited {code}")
    return (time.perf_counter() - started) * 1000


async def _fixed_cost(rounds: int) -> tuple[list[float], list[float]]:
    support = probe_now()
    on: list[float] = []
    off: list[float] = []
    with tempfile.TemporaryDirectory(prefix="zattera-isolation-bench-") as tmp:
        root = Path(tmp)
        workdir = root / "work"
        workdir.mkdir()
        sandbox = Sandbox(support, UidTable(root / "sandbox", base=0x70000000, count=65536), hidden=(root,))
        give(workdir, sandbox.uid("env:bench"))
        for index in range(rounds):
            for kind in ("sandboxed", "bare") if index % 2 == 0 else ("bare", "sandboxed"):
                (on if kind == "sandboxed" else off).append(
                    await _true_once(sandbox if kind == "sandboxed" else None, workdir)
                )
    return on, off


def run(quick: bool = True) -> list[dict[str, object]]:
    rounds = 12 if quick else 60
    figures = asyncio.run(_measure(rounds))
    on, off = figures["sandboxed"], figures["bare"]
    added = [a - b for a, b in zip(on["wall"], off["wall"], strict=True)]  # per round: noise mostly cancels
    true_on, true_off = asyncio.run(_fixed_cost(rounds * 3))
    fixed = [a - b for a, b in zip(true_on, true_off, strict=True)]
    rows = [
        row(f"`/bin/true` start → exit, sandboxed, p50 ({rounds * 3} rounds)", median(true_on), "ms"),
        row("`/bin/true` start → exit, bare, p50", median(true_off), "ms"),
        row("sandbox fixed cost: added at p50 (median of per-round differences)", median(fixed), "ms", TARGET, ANCHOR),
        row(f"instance start → listening, sandboxed, p50 ({rounds} rounds)", median(on["wall"]), "ms"),
        row("instance start → listening, sandboxed, p90", percentile(on["wall"], 90), "ms"),
        row("instance start → listening, bare, p50", median(off["wall"]), "ms"),
        row("instance start → listening, bare, p90", percentile(off["wall"], 90), "ms"),
        row("sandbox: added at p50 (median of per-round differences)", median(added), "ms", TARGET, ANCHOR),
        row("sandbox: added, per-round differences p10", percentile(added, 10), "ms"),
        row("sandbox: added, per-round differences p90", percentile(added, 90), "ms"),
        row("instance tree CPU until listening, sandboxed (bwrap, setpriv, app), p50", median(on["cpu"]), "ms"),
        row("instance tree CPU until listening, bare, p50", median(off["cpu"]), "ms"),
        row("agent CPU in spawn, sandboxed, p50", median(on["own"]), "ms"),
        row("agent CPU in spawn, bare, p50", median(off["own"]), "ms"),
    ]
    return rows


if __name__ == "__main__":
    bench_main("Isolation cost", run, __doc__, "60 rounds instead of 12")
