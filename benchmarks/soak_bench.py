"""Soak and size (issue 10 item 4): simulated nodes, envs and replicas on a 3-node NATS cluster (replicas=3)
with two replicas of every service at the product's default timers (lease TTL 3 s, renew 1 s, tick 15 s).

Figures: time to converge the seeded replicas; steady-state CPU of each service at idle (psutil, both
replicas summed) and memory per service process (largest RSS); failover time of each loop, SIGKILL of the
leader → the new leader's acquiring write (server timestamp of the ``lease.<loop>`` create), p50/p99.

Quick (default, < 3 min): 500 nodes, 200 envs, 1,000 replicas, one kill per loop.
``--full``: the issue's sizes, 5,000 nodes, 2,000 envs, 10,000 replicas, 20 kills per loop.

    .venv/bin/python -m benchmarks.soak_bench [--full]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, percentile, row
from shared.connection import connect
from shared.state.feed import StateView
from shared.txn import Writer
from tests.chaos.cluster import LOOPS, ROOT, SERVICE_OF, SERVICES, FenceAudit, Fleet, NatsCluster
from tests.orchestrator.rig import environment, release, spec

RUN = pb.ASSIGNMENT_DESIRED_RUN
HEALTHY = pb.INSTANCE_STATE_HEALTHY
DEFAULT_TIMERS = {"ZATTERA_LEASE_TTL": "3", "ZATTERA_LEASE_RENEW": "1", "ZATTERA_LOOP_TICK": "15"}
K8S = "Kubernetes default lease 15 s"
KILLS = int(os.environ.get("ZATTERA_SOAK_KILLS", "20"))
"""Kills per loop in --full mode."""


async def _seed(writer: Writer, envs: int, per_env: int) -> None:
    txns = []
    for i in range(envs):
        env_id = f"soak-{i:05d}"
        s = spec(per_env)
        s.resources.cpu_millis = 100
        s.resources.memory_mb = 128
        txn = writer.txn("seed").put(release(f"{env_id}-r1", env_id, "soak:v1", s))
        txns.append(txn.put(environment(env_id, s, active=f"{env_id}-r1")))
    for start in range(0, len(txns), 400):
        await writer.commit_many(txns[start : start + 400])


def _healthy_run(view: StateView) -> int:
    return sum(1 for a in view.assignments() if a.desired == RUN and a.observed.state == HEALTHY)


async def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.2)


def _cpu_and_memory(fleet: Fleet, window: float) -> tuple[dict[str, float], dict[str, float]]:
    handles: dict[str, list[psutil.Process]] = {}
    for proc in fleet.alive():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(proc.pid)
            p.cpu_percent(None)
            handles.setdefault(proc.service, []).append(p)
    time.sleep(window)  # the measurement window itself
    cpu: dict[str, float] = {}
    mem: dict[str, float] = {}
    for service, procs in handles.items():
        for p in procs:
            with contextlib.suppress(psutil.Error):
                cpu[service] = cpu.get(service, 0.0) + p.cpu_percent(None)
                mem[service] = max(mem.get(service, 0.0), p.memory_info().rss / 2**20)
    return cpu, mem


async def _run(quick: bool) -> list[Row]:
    nodes, envs, per_env, kills = (500, 200, 5, 1) if quick else (5000, 2000, 5, KILLS)
    rows: list[Row] = []
    base = Path.home() / ".cache" / "zattera-bench"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-", dir=base) as tmp:
        nats = NatsCluster(Path(tmp) / "nats").start()
        sim: subprocess.Popen[bytes] | None = None
        fleet = Fleet(nats.urls, Path(tmp) / "logs", env=dict(DEFAULT_TIMERS))
        try:
            await nats.provision()
            conn = await connect(nats.urls, name="soak")
            view = StateView(conn, name="soak")
            await view.start()
            audit = await FenceAudit(conn).start()
            writer = Writer(conn, view)
            sim = _spawn_sim(nats.urls, nodes, Path(tmp) / "sim.log")
            assert sim.stdout is not None
            ready = await asyncio.to_thread(sim.stdout.readline)
            assert ready.startswith(b"READY"), ready
            fleet.start_all(SERVICES, replicas=2)
            started = time.monotonic()
            await _seed(writer, envs, per_env)
            target = envs * per_env
            await _wait(lambda: _healthy_run(view) >= target, 120 if quick else 1200, "convergence")
            rows.append(row(f"converge {target:,} replicas on {nodes:,} nodes", time.monotonic() - started, "s"))
            await asyncio.sleep(5)  # let the placement burst settle before measuring idle
            cpu, mem = await asyncio.to_thread(_cpu_and_memory, fleet, 10.0 if quick else 30.0)
            for service in SERVICES:
                rows.append(row(f"idle CPU {service} (2 replicas)", cpu.get(service, float("nan")), "% of a core"))
                rows.append(row(f"memory {service} (per process)", mem.get(service, float("nan")), "MB RSS"))
            samples: dict[str, list[float]] = {}
            missed: dict[str, int] = {}
            for _ in range(kills):
                for loops in LOOPS.values():
                    for loop in loops:
                        await _wait(lambda lp=loop: _leader(audit, fleet, lp) is not None, 60, f"{loop} leader")
                        # a warm standby: every replica of the service has loaded its view and runs its loops
                        # (else the figure would include a replacement's start-up after the previous kill)
                        service = SERVICE_OF[loop]
                        await _wait(lambda sv=service: _standby_ready(fleet, sv), 120, f"{service} replicas ready")
                        proc = _leader(audit, fleet, loop)
                        assert proc is not None
                        killed = time.time()
                        fleet.kill(proc)
                        try:
                            await _wait(lambda lp=loop, t=killed: _took(audit, lp, t) is not None, 60, loop)
                        except TimeoutError:
                            missed[loop] = missed.get(loop, 0) + 1  # reported in the rows, not hidden
                            continue
                        took = _took(audit, loop, killed)
                        assert took is not None
                        samples.setdefault(loop, []).append(took - killed)
            everything = [x for xs in samples.values() for x in xs]
            for loop, xs in samples.items():
                rows.append(row(f"failover {loop} p50 ({len(xs)} kills)", percentile(xs, 50), "s"))
                rows.append(row(f"failover {loop} p99 ({len(xs)} kills)", percentile(xs, 99), "s", "≤ 2 s", K8S))
            n = len(everything)
            rows.append(row(f"failover all loops p50 ({n} kills)", percentile(everything, 50), "s"))
            rows.append(row(f"failover all loops p99 ({n} kills)", percentile(everything, 99), "s", "≤ 2 s", K8S))
            rows.append(row("failovers not seen within 60 s", sum(missed.values()), "kills", "0", str(missed or "")))
            rows.append(row("deposed-leader writes landed (fence audit)", len(audit.violations()), "writes", "0"))
            await audit.stop()
            await view.stop()
            await conn.close()
        finally:
            fleet.stop_all()
            if sim is not None:
                sim.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    sim.wait(10)
                if sim.poll() is None:
                    sim.kill()
            nats.stop()
    return rows


def _standby_ready(fleet: Fleet, service: str) -> bool:
    procs = fleet.alive(service)
    return len(procs) >= 2 and all("running (" in p.log.read_text(errors="replace") for p in procs)


def _took(audit: FenceAudit, loop: str, killed: float) -> float | None:
    return audit.first_acquisition_after(loop, killed)


def _spawn_sim(urls: str, nodes: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.sim.fleet", "--nats", urls, "--nodes", str(nodes)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
        )


def _leader(audit: FenceAudit, fleet: Fleet, loop: str):  # type: ignore[no-untyped-def]
    pid = audit.leader_pid(loop, fresh=2.5)
    proc = fleet.procs.get(pid) if pid is not None else None
    return proc if proc is not None and proc.alive() else None


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_run(quick))


def main() -> None:
    bench_main("Soak and size", run, __doc__, "5,000 nodes, 2,000 envs, 10,000 replicas, 200 kills")


if __name__ == "__main__":
    main()
