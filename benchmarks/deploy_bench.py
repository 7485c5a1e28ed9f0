"""Deployment figures: red/green wall time and how fast the orchestrator reacts to what unblocks a phase.

Run: ``python -m benchmarks.deploy_bench [--full]`` (also part of ``make bench``).

In one process against an embedded nats-server: the orchestrator loop (leader lease, fenced atomic
batches, real clock, default 15 s tick), an instant agent (tests/agent_sim.py: reports HEALTHY as soon
as it sees a replica) and the deploy API. Sequential red/green deploys of 10 replicas on 10 nodes
(20 quick, 100 full), each to SUCCEEDED (drain window 0.2 s) before the next; then source deploys
whose build the benchmark marks SUCCEEDED once the deployment waits in BUILDING.

Times are taken when an observing view applies each write (the moment any other service could see
it). Reaction = phase write seen − the change that unblocked it:

* PENDING->PLACING: the deployment's creation; PLACING->STARTING, PROMOTING->DRAINING_OLD (or ->SUCCEEDED
  when there is nothing to drain, as for the first deploy): the previous phase write (the loop's own
  cascade);
* STARTING->HEALTHCHECKING / HEALTHCHECKING->PROMOTING: the later of the phase entry and the agent report
  that made the last green replica up / healthy;
* BUILDING->PLACING: the build's SUCCEEDED write; DRAINING_OLD->SUCCEEDED: the drain deadline.

Anchor: the reference notices a finished build and every deadline on its 15 s tick (up to 15 s late).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable

from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, percentile, row
from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers, copy_of
from shared import keys as K
from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.deploy import Deployer
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent_sim import AgentSim

PH = pb.DeploymentPhase
ENV = "bench-env"
NODES = 10
REPLICAS = 10
DRAIN_WINDOW = 0.2
REACTION_TARGET_MS = 100.0
ANCHOR = "reference: BUILDING and deadlines wait for the 15 s tick (≤ 15,000 ms)"


class PhaseRecorder(StateView):
    """A view that timestamps every deployment phase it applies (perf_counter, at apply time)."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, name="bench-observer")
        self.entered: dict[str, dict[int, float]] = defaultdict(dict)
        self.changed = asyncio.Event()

    def _notify(self, kind: str, ident: str) -> None:
        super()._notify(kind, ident)
        if kind == K.DEPLOYMENT:
            d = self.deployment(ident)
            if d is not None:
                self.entered[ident].setdefault(d.phase, time.perf_counter())
                self.changed.set()

    async def until(self, cond: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.perf_counter() + timeout
        while not cond():
            self.changed.clear()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError("deployment did not progress in time")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)

    def reached(self, deployment_id: str, phase: int) -> bool:
        return phase in self.entered.get(deployment_id, {})


async def _seed_cluster(writer: Writer) -> None:
    txn = writer.txn("bench-seed")
    for i in range(NODES):
        n = pb.Node(status=pb.NODE_STATUS_ALIVE, schedulable=True, os_arch="linux/amd64")
        n.meta.id = f"node-{i:02d}"
        n.capacity.cpu_millis = 64_000
        n.capacity.memory_mb = 262_144
        n.roles.append(pb.NODE_ROLE_WORKER)
        txn.put(n)
    env = pb.Environment(project_id="p1", app_id="a1", name=ENV)
    env.meta.id = ENV
    env.service.replicas.min = REPLICAS
    txn.put(env)
    await writer.commit(txn)


def _last_report(agent: AgentSim, green_ids: set[str], states: frozenset[int]) -> float:
    """When the last green replica first reached one of ``states`` (agent acknowledgement time)."""
    first: dict[str, float] = {}
    for report in agent.reports:
        if report.assignment_id in green_ids and report.state in states:
            first.setdefault(report.assignment_id, report.at)
    return max(first.values()) if len(first) == len(green_ids) and first else float("-inf")


async def _measure(quick: bool) -> list[Row]:
    deploys = 20 if quick else 100
    source_deploys = 5 if quick else 20
    walls: list[float] = []
    reactions: dict[str, list[float]] = defaultdict(list)
    with embedded_server() as server:
        conn = await connect(server.url, name="bench")
        await provision(conn.js)
        observer = PhaseRecorder(conn)
        await observer.start()
        writer = Writer(conn, observer)
        await _seed_cluster(writer)
        orch_view = StateView(conn, name="bench-orchestrator")
        await orch_view.start()
        orchestrator = Orchestrator(
            LoopDeps(conn, orch_view, RealClock()), timers=Timers(drain_window=DRAIN_WINDOW), tick=15.0
        )
        leader = asyncio.create_task(
            run_while_leading(conn, "orchestrator", orchestrator.run, holder="bench", ttl=3, renew_interval=1)
        )
        agent = await AgentSim(conn, name="bench-agent").start()
        deployer = Deployer(writer)
        try:
            await observer.until(lambda: observer.lease("orchestrator") is not None)
            for i in range(deploys + source_deploys):
                from_source = i >= deploys
                if from_source:
                    created = await deployer.deploy_source(ENV, tarball_digest=f"sha256:{i:064x}")
                else:
                    created = await deployer.deploy_image(ENV, f"app:{i}")
                created_at = time.perf_counter()
                dep = created.deployment.meta.id
                if from_source:
                    assert created.build is not None
                    await observer.until(lambda dep=dep: observer.reached(dep, PH.DEPLOYMENT_PHASE_BUILDING))  # type: ignore[misc]
                    build = copy_of(created.build)
                    build.status = pb.BUILD_STATUS_SUCCEEDED
                    build.image_ref = f"registry/app@sha256:{i:064x}"
                    await writer.commit(writer.txn("builder").put(build))
                    built_at = time.perf_counter()
                await observer.until(lambda dep=dep: observer.reached(dep, PH.DEPLOYMENT_PHASE_SUCCEEDED))  # type: ignore[misc]
                t = observer.entered[dep]
                d = observer.deployment(dep)
                assert d is not None and d.phase == PH.DEPLOYMENT_PHASE_SUCCEEDED, d
                green = {a.meta.id for a in observer.assignments(ENV) if a.deployment_id == dep}
                up = _last_report(agent, green, frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY}))
                healthy = _last_report(agent, green, frozenset({pb.INSTANCE_STATE_HEALTHY}))
                starting, checking = t[PH.DEPLOYMENT_PHASE_STARTING], t[PH.DEPLOYMENT_PHASE_HEALTHCHECKING]
                # The promotion's write: DRAINING_OLD, or SUCCEEDED when there was nothing to drain (the first).
                promoting = t[PH.DEPLOYMENT_PHASE_PROMOTING]
                draining = t.get(PH.DEPLOYMENT_PHASE_DRAINING_OLD, t[PH.DEPLOYMENT_PHASE_SUCCEEDED])
                placing = t[PH.DEPLOYMENT_PHASE_PLACING]
                if from_source:
                    reactions["build"].append(placing - built_at)
                else:
                    walls.append(draining - created_at)
                    reactions["phase"].append(placing - created_at)
                reactions["phase"] += [
                    starting - placing,
                    checking - max(starting, up),
                    promoting - max(checking, healthy),
                    draining - promoting,
                ]
                if d.HasField("drain_deadline"):
                    # The drain deadline is wall-clock time; the recorder's times are perf_counter.
                    lateness = time.time() - (time.perf_counter() - t[PH.DEPLOYMENT_PHASE_SUCCEEDED])
                    reactions["drain"].append(lateness - d.drain_deadline.ToNanoseconds() / 1e9)
        finally:
            leader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leader
            await agent.stop()
            await orch_view.stop()
            await observer.stop()
            await conn.close()
    every = reactions["phase"] + reactions["build"] + reactions["drain"]
    size = f"{deploys} sequential red/green deploys x {REPLICAS} replicas, instant agent"
    ms = 1000.0
    return [
        row("deploy wall time PENDING->DRAINING_OLD p50", median(walls) * ms, "ms", "", size),
        row("deploy wall time PENDING->DRAINING_OLD p99", percentile(walls, 99) * ms, "ms", "", size),
        row("reaction to an unblocking change p50", median(every) * ms, "ms", "", "all phase writes"),
        row(
            "reaction to an unblocking change p99",
            percentile(every, 99) * ms,
            "ms",
            f"<= {REACTION_TARGET_MS:.0f} ms",
            ANCHOR,
        ),
        row(
            "build SUCCEEDED -> PLACING p99",
            percentile(reactions["build"], 99) * ms,
            "ms",
            f"<= {REACTION_TARGET_MS:.0f} ms",
            f"{source_deploys} source deploys; {ANCHOR}",
        ),
        row(
            "drain deadline -> SUCCEEDED p99",
            percentile(reactions["drain"], 99) * ms,
            "ms",
            f"<= {REACTION_TARGET_MS:.0f} ms",
            ANCHOR,
        ),
    ]


def run(quick: bool = True) -> list[dict[str, object]]:
    return asyncio.run(_measure(quick))


def main() -> None:
    bench_main("Deployments", run, __doc__, "100 deploys instead of 20")


if __name__ == "__main__":
    main()
