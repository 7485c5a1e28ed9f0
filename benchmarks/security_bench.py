"""The cost of ``--secure`` (issue 15 item 6), open and secured side by side in one run.

Each mode gets its own embedded nats-server and the join service as its own process, which opens the
agents' view consumers in both modes (secured: operator mode with the role accounts of ``zattera up --secure``;
the join service also relays the agents' state writes). Figures per mode:

* **converge**: 500 simulated agents (quick: 40) in 4 worker processes, each on its own connection — its
  own agent credential when secured — with the product's agent view (in both modes the one pulled consumer
  control opens for the node) and the product's writer. Control writes 1,000 RUN
  assignments (2 per node; quick: 80) in batches; the figure is the time until every one has its
  ``observed`` HEALTHY report stored (each agent sees its assignments through its view and reports through
  its writer, i.e. through the relay when secured). Placement and the control loops are the same code in
  both modes and not part of it.
* **route propagation**: 20 proxies (their own proxy credentials when secured, through the ``PROXIES``
  account's stream import) subscribed to ``zattera.routes.snapshot``; 200 snapshots of 2 KB published by
  control, one every 10 ms; the time from publish to receipt at each proxy, p50 and p99.

    .venv/bin/python -m benchmarks.security_bench [--full]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, median, percentile, row
from cli.supervised import Supervised
from services.agent.agent import view_filters
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.provisioning import provision
from shared.security.permissions import Role
from shared.security.setup import SecureSetup, prepare
from shared.security.views import request_view
from shared.state.feed import StateView
from shared.subjects import ROUTES_SNAPSHOT_SUBJECT
from shared.txn import Writer
from tests.agent_sim import AgentSim

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4
PROXIES = 20
ROUNDS = 5
"""Full mode: open and secured measured this many times each, alternating; the table shows medians (one
convergence of 1,000 replicas varies by ±30 % from run to run on a 2-core machine)."""
SNAPSHOTS = 200
SNAPSHOT_BYTES = 2048


class Mode:
    def __init__(self, base: Path, secure: bool) -> None:
        self.secure = secure
        self.setup: SecureSetup | None = prepare(base / "security") if secure else None
        extra = self.setup.server_config() if self.setup else ""
        self.server = EmbeddedNats(data_dir=base / "nats", extra_config=extra)
        self.base = base
        self.join: Supervised | None = None

    @property
    def name(self) -> str:
        return "secured" if self.secure else "open"

    def creds(self, role: Role, name: str) -> str | None:
        return str(self.setup.creds(role, name)) if self.setup else None

    def control_creds(self) -> str | None:
        return str(self.setup.control_creds) if self.setup else None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Mode]:
        self.server.start()
        try:
            conn = await connect(self.server.url, name="bench-provision", creds=self.control_creds())
            await provision(conn.js)
            await conn.close()
            self.join = _join_service(self.server.url, self.setup, self.base)
            yield self
        finally:
            if self.join is not None:
                self.join.terminate()
                self.join.wait_or_kill(time.monotonic() + 10)
            self.server.stop()


def _join_service(url: str, setup: SecureSetup | None, base: Path) -> Supervised:
    """The join service in its own process, as ``zattera up`` runs it (view consumers in both modes; the relay
    when secured)."""
    env = {**os.environ, "ZATTERA_NATS_URL": url, "ZATTERA_NATS_CREDS": str(setup.control_creds) if setup else ""}
    join = Supervised("join", [sys.executable, "-m", "services.join"], base / "join.log", env)
    join.env["ZATTERA_DATA_DIR"] = str(base)
    join.start()
    return join


async def _agent(url: str, setup: SecureSetup | None, node: str) -> tuple[Connection, AgentSim]:
    creds = str(setup.creds(Role.AGENT, node)) if setup else None
    conn = await connect(url, name=f"sim-{node}", creds=creds)
    opener = partial(request_view, conn, node, secured=setup is not None)
    view = StateView(conn, name=f"agent-{node}", filters=view_filters(node), open_consumer=opener)
    return conn, AgentSim(conn, view=view)


async def _start_agent(url: str, setup: SecureSetup | None, node: str) -> tuple[Connection, AgentSim]:
    failure: Exception | None = None
    for _ in range(100):  # the join service (view consumers) may still be starting
        conn, sim = await _agent(url, setup, node)
        try:
            await sim.start()
            return conn, sim
        except Exception as exc:
            failure = exc
            await conn.close()
            await asyncio.sleep(0.5)
    detail = getattr(failure, "description", "") or ""
    raise TimeoutError(f"agent {node} could not start its view: {failure!r} {detail}")


async def _agents_worker(url: str, security: str, names: list[str]) -> None:
    """A worker process's share of the simulated agents (one Python process cannot serve 500 views and keep
    up with their heartbeats): start them, say READY, run until stdin closes."""
    setup = SecureSetup(Path(security), None) if security else None
    agents = []
    for start in range(0, len(names), 10):
        agents += await asyncio.gather(*(_start_agent(url, setup, n) for n in names[start : start + 10]))
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.read)

    async def stop(conn: Connection, sim: AgentSim) -> None:
        await sim.stop()
        await conn.close()

    await asyncio.gather(*(stop(conn, sim) for conn, sim in agents))  # each close drains for up to 2 s


def _spawn_workers(mode: Mode, names: list[str]) -> list[subprocess.Popen[bytes]]:
    security = str(mode.setup.directory) if mode.setup else ""
    share = -(-len(names) // WORKERS)
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.security_bench",
                "--agents",
                mode.server.url,
                security,
                ",".join(names[i : i + share]),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for i in range(0, len(names), share)
    ]


def _assignment(node: str, index: int) -> pb.Assignment:
    a = pb.Assignment(node_id=node, release_id="r1", environment_id=f"e{index % 50}", project_id="p1")
    a.meta.id = f"a-{node}-{index}"
    a.desired = pb.ASSIGNMENT_DESIRED_RUN
    return a


async def _converge(mode: Mode, nodes: int, replicas: int) -> float:
    names = [f"n{i:04d}" for i in range(nodes)]
    workers = _spawn_workers(mode, names)
    for worker in workers:
        assert worker.stdout is not None
        ready = await asyncio.to_thread(worker.stdout.readline)
        assert ready.startswith(b"READY"), f"{mode.name}: an agents worker failed to start"
    control = await connect(mode.server.url, name="bench-control", creds=mode.control_creds())
    view = StateView(control, name="bench-control")
    await view.start()
    writer = Writer(control, view)
    try:
        started = time.perf_counter()
        assignments = [_assignment(names[i % nodes], i) for i in range(replicas)]
        txns = [writer.txn("seed").put(a) for a in assignments]
        for start in range(0, len(txns), 200):
            await writer.commit_many(txns[start : start + 200])

        def healthy() -> int:
            return sum(
                1
                for a in assignments
                if (o := view.observed(a.node_id, a.meta.id)) is not None and o.state == pb.INSTANCE_STATE_HEALTHY
            )

        while healthy() < replicas:
            if time.perf_counter() - started > 300:
                raise TimeoutError(f"{mode.name}: {healthy()} of {replicas} replicas reported")
            await asyncio.sleep(0.05)
        return time.perf_counter() - started
    finally:
        await view.stop()
        await control.close()
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.close()
        for worker in workers:  # a worker slow to stop (500 views closing on a loaded machine) is killed
            try:
                await asyncio.to_thread(worker.wait, 60)
            except subprocess.TimeoutExpired:
                worker.kill()


async def _route_propagation(mode: Mode) -> list[float]:
    delays: list[float] = []
    proxies = [
        await connect(mode.server.url, name=f"proxy-{i}", creds=mode.creds(Role.PROXY, f"p{i}")) for i in range(PROXIES)
    ]
    received = asyncio.Event()
    expected = PROXIES * SNAPSHOTS

    async def on_snapshot(msg: object) -> None:
        sent = float(msg.headers["Bench-Sent"])  # type: ignore[attr-defined]
        delays.append(time.perf_counter() - sent)
        if len(delays) >= expected:
            received.set()

    for proxy in proxies:
        await proxy.nc.subscribe(ROUTES_SNAPSHOT_SUBJECT, cb=on_snapshot)
        await proxy.nc.flush()
    control = await connect(mode.server.url, name="bench-routes", creds=mode.control_creds())
    body = os.urandom(SNAPSHOT_BYTES)
    try:
        for _ in range(SNAPSHOTS):
            await control.nc.publish(ROUTES_SNAPSHOT_SUBJECT, body, headers={"Bench-Sent": repr(time.perf_counter())})
            await asyncio.sleep(0.01)
        await asyncio.wait_for(received.wait(), 30)
    finally:
        await control.close()
        for proxy in proxies:
            await proxy.close()
    return delays


async def _measure(mode: Mode, nodes: int, replicas: int) -> dict[str, float]:
    async with mode.running():
        took = await _converge(mode, nodes, replicas)
        delays = await _route_propagation(mode)
    return {"converge": took, "p50": percentile(delays, 50) * 1000, "p99": percentile(delays, 99) * 1000}


async def _run(quick: bool) -> list[Row]:
    nodes, replicas = (40, 80) if quick else (500, 1000)
    nodes = int(os.environ.get("ZATTERA_SECURITY_BENCH_NODES", nodes))
    replicas = 2 * nodes
    rounds = 1 if quick else ROUNDS
    rows: list[Row] = []
    samples: dict[str, dict[str, list[float]]] = {"open": {}, "secured": {}}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="zattera-security-bench-") as tmp:
        for number in range(rounds):
            # Alternating which mode goes first: a machine's drift over the run lands on both alike.
            for secure in (False, True) if number % 2 == 0 else (True, False):
                mode = Mode(Path(tmp) / f"{'secured' if secure else 'open'}-{number}", secure)
                try:
                    for figure, value in (await _measure(mode, nodes, replicas)).items():
                        samples[mode.name].setdefault(figure, []).append(value)
                except Exception as exc:  # reported in the table: one mode failing must not hide the other
                    failures[mode.name] = str(exc)[:200]
    figures = {name: {k: median(v) for k, v in got.items()} for name, got in samples.items() if got}
    label = f"{replicas:,} replicas on {nodes:,} nodes" + (f", median of {rounds} rounds" if rounds > 1 else "")
    nan = float("nan")
    for name in ("open", "secured"):
        f = figures.get(name, {})
        why = f"failed: {failures[name]}" if name in failures else ""
        rows.append(row(f"{name}: converge {label}", f.get("converge", nan), "s", "", why))
        rows.append(row(f"{name}: route propagation p50 ({PROXIES} proxies)", f.get("p50", nan), "ms"))
        rows.append(row(f"{name}: route propagation p99 ({PROXIES} proxies)", f.get("p99", nan), "ms"))
    if len(figures) == 2 and not failures:
        for figure, what in (("converge", "converge"), ("p99", "route propagation p99")):
            ratio = figures["secured"][figure] / figures["open"][figure] * 100 - 100
            rows.append(row(f"secured vs open: {what}", ratio, "%", "≤ +20 %", "same run, same machine"))
    return rows


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_run(quick))


def main() -> None:
    if sys.argv[1:2] == ["--agents"]:
        url, security, names = sys.argv[2:5]
        asyncio.run(_agents_worker(url, security, names.split(",")))
        return
    bench_main("Cost of --secure", run, __doc__, "500 nodes, 1,000 replicas")


if __name__ == "__main__":
    main()
