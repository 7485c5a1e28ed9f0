"""Instance logs benchmark: a real agent process on an embedded nats-server, real app processes.

* **throughput**: one instance writes lines as fast as it can (Python, buffered stdout); lines/s that reach
  the env's log stream (counted by a subscriber, first to last batch) and the agent's CPU (psutil, over
  the same window) per 10,000 lines/s. Lines the agent had to drop (backlog bound) are reported apart.
* **delay**: an instance writes one line carrying its write time every 10 ms; ``zattera logs -f --json``
  (the real CLI, a subprocess) prints them; delay = print time - write time, p50 and p99.
* **app slowdown**: the same writer, the same number of lines, its own timing (wall and CPU seconds):
  stdout to /dev/null (run directly, A) versus under the agent (stdout captured and shipped, B), in
  alternating pairs A/B, B/A, A/B …; the figure is the median of the pairs' B/A − 1, with their spread.
  The app is pinned to one core and the agent and nats-server to the other (``sched_setaffinity``), so the
  capture's work does not compete with the app for a core; other jobs on the machine still can. Three
  apps: one that only logs, and two that do a unit of work (200 or 1,000 empty loop turns, a few µs or
  ~0.1 ms on a quiet core) per line they log, as an app logging each request it serves.
* **capture floor**: the app that only logs, with no agent at all, its stdout to /dev/null versus to a
  file on the agent's disk (what the agent captures into) and versus a pipe (1 MiB) drained every 5 ms by
  a reader on the other core (the cheapest way to take bytes from a process: no wake-up per write). What
  the app pays here is the kernel's copy of its bytes, the least any capture that keeps the output costs.

``python -m benchmarks.logs_bench`` (quick, < 30 s) or ``--full`` (more lines and rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, percentile, row
from services.agent.instance_env import PASSED_THROUGH_ENV
from shared import keys as K
from shared.applogs import LogLimits, app_log_subject, app_logs_stream_config
from shared.connection import Connection, connect
from shared.provisioning import create_or_update_stream, provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import assignment, process_ref, release

ENV = "BENCHENV"
NODE = "bench"
REPO_ROOT = Path(__file__).resolve().parents[1]

WRITER = """
import os, sys, time
from pathlib import Path

mode = sys.argv[1]
if mode == "flood":  # count lines, `work` empty loop turns of "real work" before each
    count, work, result, cpu = int(sys.argv[2]), range(int(sys.argv[3])), sys.argv[4], int(sys.argv[5])
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    write = sys.stdout.write
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        for _ in work:
            pass
        write(f"flood line {i} of the logs benchmark, with some text to look like a real log line\\n")
    sys.stdout.flush()
    Path(result).write_text(f"{time.perf_counter() - started} {time.process_time() - cpu}")
else:
    interval = float(sys.argv[2])
    while True:
        print(f"{time.time():.6f}", flush=True)
        time.sleep(interval)
time.sleep(3600)
"""


@dataclass(frozen=True)
class App:
    label: str
    lines: int
    work: int
    """Empty loop turns before each line (0 = nothing but logging)."""


@dataclass(frozen=True)
class Sizes:
    flood_lines: int
    delay_seconds: float
    apps: tuple[App, ...]
    slowdown_rounds: int


QUICK = Sizes(
    flood_lines=1_000_000,
    delay_seconds=3.0,
    apps=(
        App("app only logging", 300_000, 0),
        App("app working 200 loop turns per line", 50_000, 200),
        App("app working 1,000 loop turns per line", 5_000, 1_000),
    ),
    slowdown_rounds=4,
)
FULL = Sizes(
    flood_lines=10_000_000,
    delay_seconds=20.0,
    apps=(
        App("app only logging", 2_000_000, 0),
        App("app working 200 loop turns per line", 200_000, 200),
        App("app working 1,000 loop turns per line", 20_000, 1_000),
    ),
    slowdown_rounds=10,
)

APP_CPU, CAPTURE_CPU = (0, 1) if len(os.sched_getaffinity(0)) >= 2 and {0, 1} <= os.sched_getaffinity(0) else (-1, -1)
"""The app's core, and the core of the agent and nats-server (-1: fewer than two cores, nothing pinned)."""


INSTANCE_ENV = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
"""The environment of the writer run without the agent: what an instance gets from its node."""


def pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` (nats-server's Go threads too: the affinity is per thread) onto ``cpu``."""
    if cpu < 0:
        return
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(thread), {cpu})


class Rig:
    def __init__(self, url: str, root: Path) -> None:
        self.url = url
        self.root = root
        self.app = root / "app"
        self.app.mkdir()
        (self.app / "writer.py").write_text(WRITER)
        self.agent: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Rig:
        self.conn = await connect(self.url, name="logs-bench")
        await provision(self.conn.js)
        await create_or_update_stream(self.conn.js, app_logs_stream_config(ENV, LogLimits(4 << 30, 3600.0), 1))
        self.view = StateView(self.conn, name="logs-bench")
        await self.view.start()
        self.writer = Writer(self.conn, self.view)
        env = pb.Environment(name="bench")
        env.meta.id = ENV
        await self.writer.commit(self.writer.txn().put(env))
        self.agent = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "services.agent", "--nats", self.url, "--node-id", NODE, "--stop-on-exit"),
            *("--data-dir", str(self.root / "agent"), "--log-level", "WARNING"),
            cwd=REPO_ROOT,
            # Bypassed: the app sandbox (its cost is isolation_bench's). The bench's apps write their results
            # beside the bench, where a sandboxed app can rightly write nothing.
            env={
                **os.environ,
                "OTEL_TRACES_EXPORTER": "none",
                "ZATTERA_AGENT_RECONCILE_TICK": "0.5",
                "ZATTERA_AGENT_SANDBOX": "off",
            },
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.agent is not None:
            self.agent.terminate()
            await self.agent.wait()
        await self.view.stop()
        await self.conn.close()

    def instance(self, command: str) -> tuple[pb.Release, pb.Assignment]:
        rel = release(process_ref(self.app, command), env_id=ENV, healthcheck=False)
        return rel, assignment(NODE, rel)

    async def start(self, rel: pb.Release, a: pb.Assignment) -> None:
        await self.writer.commit(self.writer.txn().put(rel).put(a))

    async def run_instance(self, command: str) -> pb.Assignment:
        rel, a = self.instance(command)
        await self.start(rel, a)
        return a

    async def remove(self, a: pb.Assignment) -> None:
        await self.writer.commit(self.writer.txn().delete(K.assignment(NODE, a.meta.id)))
        while self.view.observed(NODE, a.meta.id) is not None:  # noqa: ASYNC110 (the agent removes it)
            await asyncio.sleep(0.05)

    def agent_cpu(self) -> float:
        assert self.agent is not None
        times = psutil.Process(self.agent.pid).cpu_times()
        return float(times.user + times.system)


@contextlib.asynccontextmanager
async def counting(conn: Connection, instance: str) -> AsyncIterator[dict[str, float]]:
    """Counts the lines (and dropped-line notices) of one instance as the stream stores them."""
    seen: dict[str, float] = {"lines": 0, "dropped": 0, "first": 0.0, "last": 0.0}

    async def on_batch(msg: object) -> None:
        batch = cpb.InstanceLogBatch.FromString(msg.data)  # type: ignore[attr-defined]
        now = time.perf_counter()
        seen["first"] = seen["first"] or now
        seen["last"] = now
        dropped = sum(line.dropped for line in batch.lines if line.dropped)
        seen["dropped"] += dropped
        seen["lines"] += len(batch.lines) - (1 if dropped else 0)

    sub = await conn.nc.subscribe(app_log_subject(ENV, instance), cb=on_batch)
    try:
        yield seen
    finally:
        await sub.unsubscribe()


async def throughput(rig: Rig, sizes: Sizes) -> list[Row]:
    rel, a = rig.instance(
        f"{sys.executable} writer.py flood {sizes.flood_lines} 0 {rig.root / 'flood-result'} {APP_CPU}"
    )
    async with counting(rig.conn, a.meta.id) as seen:
        await rig.start(rel, a)
        while not seen["first"]:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        cpu_start = rig.agent_cpu()
        while seen["lines"] + seen["dropped"] < sizes.flood_lines:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        cpu = rig.agent_cpu() - cpu_start
    await rig.remove(a)
    window = max(seen["last"] - seen["first"], 1e-6)
    rate = seen["lines"] / window
    return [
        row("logs: lines/s delivered to the stream (one instance flooding)", rate, "lines/s", "≥ 50,000", "issue 16"),
        row("logs: agent CPU per 10,000 lines/s", cpu / window / (rate / 10_000) * 100, "% of a core", "", "issue 16"),
        row("logs: lines dropped by the backlog bound during the flood", seen["dropped"], "lines", "", "by design"),
    ]


async def delay(rig: Rig, sizes: Sizes) -> list[Row]:
    a = await rig.run_instance(f"{sys.executable} writer.py paced 0.01")
    follower = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from cli.main import main; sys.argv[0] = 'zattera'; main()",
        "--nats",
        rig.url,
        "logs",
        "--env",
        ENV,
        "-f",
        "-n",
        "0",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
    )
    assert follower.stdout is not None
    delays: list[float] = []
    started = 0.0
    try:
        while not started or time.time() < started + sizes.delay_seconds:
            line = await asyncio.wait_for(follower.stdout.readline(), 30)
            received = time.time()
            written = float(json.loads(line)["line"])
            started = started or received  # the CLI follows: lines written from now on are measured
            if written >= started:
                delays.append((received - written) * 1000)
    finally:
        follower.kill()
        await follower.wait()
    await rig.remove(a)
    return [
        row("logs: zattera logs -f delay p50", median(delays), "ms", "", "issue 16"),
        row("logs: zattera logs -f delay p99", percentile(delays, 99), "ms", "≤ 500 ms", "issue 16"),
    ]


async def slowdown(rig: Rig, app: App, rounds: int) -> list[Row]:
    direct: list[tuple[float, float]] = []
    shipped: list[tuple[float, float]] = []
    command = f"{sys.executable} writer.py flood {app.lines} {app.work}"

    async def to_devnull(round_: int) -> None:
        result = rig.root / f"devnull-{app.work}-{round_}"
        await _direct(rig, f"{command} {result} {APP_CPU}", result)
        direct.append(elapsed(result))

    async def under_the_agent(round_: int) -> None:
        result = rig.root / f"agent-{app.work}-{round_}"
        a = await rig.run_instance(f"{command} {result} {APP_CPU}")
        await until_written(result)
        shipped.append(elapsed(result))
        await rig.remove(a)

    for round_ in range(rounds):  # A/B then B/A: neither side always runs first, on a warmer machine
        pair = (to_devnull, under_the_agent) if round_ % 2 == 0 else (under_the_agent, to_devnull)
        for measure_one in pair:
            await measure_one(round_)
    rows = [
        row(f"logs: {app.label}: lines/s to /dev/null", app.lines / median([w for w, _ in direct]), "lines/s", "", ""),
        row(f"logs: {app.label}: lines/s captured", app.lines / median([w for w, _ in shipped]), "lines/s", "", ""),
    ]
    for what, index in (("wall time", 0), ("its CPU time", 1)):
        slowed = [(b[index] / a[index] - 1) * 100 for a, b in zip(direct, shipped, strict=True)]
        spread = f"{rounds} pairs: {min(slowed):+.1f} … {max(slowed):+.1f} %"
        rows.append(row(f"logs: {app.label}: slowed ({what}, median of pairs)", median(slowed), "%", "≤ 5 %", spread))
    return rows


def capture_floor(rig: Rig, app: App, rounds: int) -> list[Row]:
    """The writer with no agent: its CPU time to a file and to a lazily drained pipe, against /dev/null."""
    command = [sys.executable, "writer.py", "flood", str(app.lines), str(app.work)]

    def timed(stdout: int, label: str, round_: int) -> float:
        result = rig.root / f"floor-{label}-{round_}"
        argv = [*command, str(result), str(APP_CPU)]
        with subprocess.Popen(argv, cwd=rig.app, stdout=stdout, env=INSTANCE_ENV) as proc:
            while not elapsed(result)[0]:  # the writer then sleeps, as an instance that stays up
                time.sleep(0.01)
            proc.kill()
        return elapsed(result)[1]

    def to_devnull(round_: int) -> float:
        with open(os.devnull, "wb") as sink:
            return timed(sink.fileno(), "devnull", round_)

    def to_file(round_: int) -> float:
        path = rig.root / "floor-output.log"
        with path.open("wb") as sink:
            try:
                return timed(sink.fileno(), "file", round_)
            finally:
                path.unlink()

    def to_pipe(round_: int) -> float:
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.set_blocking(read_end, False)

        def drain() -> None:  # never blocks in read() or poll(): either would make each write wake it
            if CAPTURE_CPU >= 0:
                os.sched_setaffinity(0, {CAPTURE_CPU})
            while True:
                try:
                    if not os.read(read_end, 1 << 20):
                        return
                except BlockingIOError:
                    time.sleep(0.005)

        reader = threading.Thread(target=drain)
        reader.start()
        try:
            with os.fdopen(write_end, "wb") as sink:
                return timed(sink.fileno(), "pipe", round_)
        finally:
            reader.join()
            os.close(read_end)

    sides = {"a file": to_file, "a pipe drained every 5 ms": to_pipe}
    cpu: dict[str, list[float]] = {"/dev/null": [], **{label: [] for label in sides}}
    for round_ in range(rounds):  # /dev/null first and last in turn, as in the pairs above
        order = [("/dev/null", to_devnull), *sides.items()]
        for label, measure_one in order if round_ % 2 == 0 else reversed(order):
            cpu[label].append(measure_one(round_))
    base = median(cpu["/dev/null"])
    rows = [row(f"logs: floor, no agent: {app.label} to /dev/null, its CPU time", base, "s", "", "")]
    for label in sides:
        rows.append(
            row(
                f"logs: floor, no agent: {app.label} to {label}, CPU vs /dev/null",
                (median(cpu[label]) / base - 1) * 100,
                "%",
                "≤ 5 %",
                f"{rounds} rounds, medians {base:.2f} s vs {median(cpu[label]):.2f} s",
            )
        )
    return rows


def elapsed(result: Path) -> tuple[float, float]:
    """The writer's own timing: wall and CPU seconds ((0, 0) = not written yet)."""
    with contextlib.suppress(OSError, ValueError):
        wall, cpu = result.read_text().split()
        return float(wall), float(cpu)
    return 0.0, 0.0


async def until_written(result: Path) -> None:
    while not elapsed(result)[0]:  # noqa: ASYNC110 (another process writes it)
        await asyncio.sleep(0.01)


async def _direct(rig: Rig, command: str, result: Path) -> None:
    """The writer on its own with stdout to /dev/null (a process like the instance, with no reader at all)."""
    proc = await asyncio.create_subprocess_exec(
        *command.split(),
        cwd=rig.app,
        stdout=asyncio.subprocess.DEVNULL,
        env=INSTANCE_ENV,
    )
    await until_written(result)
    proc.kill()
    await proc.wait()


async def measure(sizes: Sizes) -> list[Row]:
    with embedded_server() as server, tempfile.TemporaryDirectory(prefix="zattera-logs-bench-") as tmp:
        async with Rig(server.url, Path(tmp)) as rig:
            rows = [*await throughput(rig, sizes), *await delay(rig, sizes)]
            assert server.pid is not None and rig.agent is not None
            pin(server.pid, CAPTURE_CPU)  # from here on only: the flood above may use every core
            pin(rig.agent.pid, CAPTURE_CPU)
            for app in sizes.apps:
                rows += await slowdown(rig, app, sizes.slowdown_rounds)
            rows += await asyncio.to_thread(capture_floor, rig, sizes.apps[0], sizes.slowdown_rounds)
            load = os.getloadavg()[0]
            rows.append(row("logs: machine load average (1 min) at the end", load, "", "", "other jobs share it"))
            return rows


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(measure(QUICK if quick else FULL))


if __name__ == "__main__":
    bench_main("Instance logs", run, __doc__, "10M lines flooded, 20 s of delay samples, 10 slowdown pairs")
