"""The scripted workload of the fault suite and the fault injectors.

Seed: worker nodes (heartbeating into ``zattera-live``), stateless envs and one stateful env with an
active release each; the scheduler places their replicas (and creates the stateful volume), the
simulated agent (``tests.agent_sim.AgentSim``) reports them HEALTHY. Then deploys (``shared.deploy``),
rollbacks, scale changes, node drains and agent kills run while the faults land. Every write the
workload got acknowledged is recorded (``acked``) and checked afterwards from a fresh connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection, connect
from shared.deploy import Deployer, DeployError, FailedPrecondition
from shared.deployments import is_terminal
from shared.live import publish_node_heartbeat
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.txn import CommitUnknown, Conflict, TxnError, Writer
from tests.agent_sim import AgentSim
from tests.chaos.cluster import (
    DEPLOYMENT_BOUND,
    LOOPS,
    FenceAudit,
    Fleet,
    InvariantWatcher,
    NatsCluster,
    Proc,
    lease_losses,
    refused_stale_writes,
)
from tests.factories import node
from tests.orchestrator.rig import copied, environment, release, spec
from tests.waiting import eventually

log = logging.getLogger(__name__)

RUN = pb.ASSIGNMENT_DESIRED_RUN
SERVING = (pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY)
STATELESS = ("web-1", "web-2")
STATEFUL = "db"
WORKERS = ("w1", "w2", "w3", "w4")
LEASE_TTL = 1.0
LEASE_RENEW = 0.3


@dataclass
class Stats:
    faults: dict[str, int] = field(default_factory=dict)
    refused_stale_writes: int = 0
    frozen_leaders_stepped_down: int = 0
    deploys: int = 0
    rollbacks: int = 0
    scale_changes: int = 0
    drains: int = 0
    drained: int = 0
    agent_kills: int = 0
    failover_seconds: dict[str, list[float]] = field(default_factory=dict)
    nats_leader_kills: int = 0

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1


class Heartbeats:
    """Node heartbeats into ``zattera-live`` for every node whose agent is alive."""

    def __init__(self, conn: Connection, nodes: tuple[str, ...], every: float = 1.0) -> None:
        self.conn = conn
        self.nodes = nodes
        self.dead: set[str] = set()
        self.every = every
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            for n in self.nodes:
                if n in self.dead:
                    continue
                hb = cpb.Heartbeat(node_id=n, cpu_percent=5.0)
                hb.time.GetCurrentTime()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(publish_node_heartbeat(self.conn, hb), 2.0)
            await asyncio.sleep(self.every)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass
class Run:
    """One chaos run: the cluster, the services, the observers and the workload's own client."""

    nats: NatsCluster
    fleet: Fleet
    conn: Connection
    watcher: InvariantWatcher
    writer: Writer
    deployer: Deployer
    agent: AgentSim
    heartbeats: Heartbeats
    audit: FenceAudit
    rng: random.Random
    stats: Stats = field(default_factory=Stats)
    acked: dict[str, int] = field(default_factory=dict)
    deployments: dict[str, float] = field(default_factory=dict)  # id -> created (monotonic)
    errors: list[str] = field(default_factory=list)
    _marker: int = 0

    # ------------------------------------------------------------------ setup / teardown

    @classmethod
    async def start(cls, base: Path, *, seed: int = 1, replicas: int = 2) -> Run:
        nats = NatsCluster(base / "nats").start()
        conn: Connection | None = None
        try:
            await nats.provision()
            conn = await connect(nats.urls, name="chaos-workload")
            watcher = InvariantWatcher(conn)
            await watcher.start()
            audit = await FenceAudit(conn).start()
            writer = Writer(conn, watcher)
            agent = await AgentSim(conn, name="chaos-agents").start()
        except BaseException:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 10)
            nats.stop()
            raise
        heartbeats = Heartbeats(conn, WORKERS)
        heartbeats.start()
        fleet = Fleet(nats.urls, base / "logs")
        run = cls(nats, fleet, conn, watcher, writer, Deployer(writer), agent, heartbeats, audit, random.Random(seed))
        fleet.start_all(replicas=replicas)
        return run

    async def close(self) -> None:
        self.fleet.stop_all()
        for step in (self.heartbeats.stop(), self.agent.stop(), self.audit.stop(), self.watcher.stop()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(step, 10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.close(), 10)
        self.nats.stop()

    # ------------------------------------------------------------------ writes the workload makes

    async def write(self, build: Callable[[], pb.Node | pb.Environment | pb.Project], within: float = 60.0) -> None:
        """A single-key write decided on the current view; refused or unknown outcomes are re-decided until
        ``within`` seconds have passed (a stream-leader election after a NATS kill alone takes ~5 s)."""
        deadline = time.monotonic() + within
        last: Exception | None = None
        while time.monotonic() < deadline:
            await self.watcher.wait_fresh(30)
            msg = build()
            try:
                await self.writer.commit(self.writer.txn("workload").put(msg))
            except (Conflict, CommitUnknown, TxnError) as exc:
                last = exc
                await asyncio.sleep(0.1)
                continue
            except Exception as exc:  # connection trouble while a NATS server is down
                last = exc
                log.info("workload write retried: %r", exc)
                await asyncio.sleep(0.2)
                continue
            key = K.key_of(msg)
            self.acked[key] = self.watcher.rev(key)
            return
        raise AssertionError(f"workload write never landed within {within:.0f}s (last: {last!r}): {build()}")

    async def marker(self) -> None:
        """An acknowledged write no service ever touches: it must survive every fault."""
        self._marker += 1

        def build() -> pb.Project:
            p = pb.Project(name=f"marker {self._marker}")
            p.meta.id = f"chaos-{self._marker:04d}"
            return p

        await self.write(build)

    async def seed(self) -> None:
        txn = self.writer.txn("seed")
        for w in WORKERS:
            txn.put(node(w, cpu=8000, mem=16384))
        for env_id in STATELESS:
            s = spec(2)
            txn.put(release(f"{env_id}-r1", env_id, "app:v1", s)).put(environment(env_id, s, active=f"{env_id}-r1"))
        s = spec(1, max_replicas=1, stateful=True, volume="data")
        txn.put(release(f"{STATEFUL}-r1", STATEFUL, "db:v1", s)).put(environment(STATEFUL, s, active=f"{STATEFUL}-r1"))
        await self.writer.commit(txn)
        await eventually(self.converged, 60, "seeded envs placed and healthy")

    def converged(self) -> bool:
        for env in self.watcher.envs():
            want = env.service.replicas.min
            serving = [
                a
                for a in self.watcher.assignments(env.meta.id)
                if a.desired == RUN and a.release_id == env.active_release_id and a.observed.state in SERVING
            ]
            if len(serving) < want:
                return False
        return True

    # ------------------------------------------------------------------ workload steps

    async def deploy(self, env_id: str, *, rollback: bool = False) -> str | None:
        """Create a deployment once the env accepts one (the blocking rule); returns its id."""
        deadline = time.monotonic() + DEPLOYMENT_BOUND
        while time.monotonic() < deadline:
            try:
                await self.watcher.wait_fresh(30)
                if rollback:
                    d = await self.deployer.rollback(env_id)
                    self.stats.rollbacks += 1
                else:
                    self.stats.deploys += 1
                    d = (await self.deployer.deploy_image(env_id, f"{env_id}:v{self.stats.deploys + 1}")).deployment
            except FailedPrecondition as exc:
                if rollback and "previous" in str(exc):
                    return None
                await asyncio.sleep(0.1)
                continue
            except (DeployError, TxnError, Exception) as exc:
                log.info("deploy retried: %r", exc)
                await asyncio.sleep(0.2)
                continue
            self.deployments[d.meta.id] = time.monotonic()
            self.acked[K.deployment(d.meta.id)] = self.watcher.rev(K.deployment(d.meta.id))
            return d.meta.id
        self.errors.append(f"{env_id}: no deployment could be created within {DEPLOYMENT_BOUND}s")
        return None

    async def wait_terminal(self, deployment_id: str) -> None:
        created = self.deployments[deployment_id]

        def done() -> bool:
            d = self.watcher.deployment(deployment_id)
            return d is not None and is_terminal(d.phase)

        try:
            await eventually(done, max(1.0, created + DEPLOYMENT_BOUND - time.monotonic()), deployment_id)
        except AssertionError:
            d = self.watcher.deployment(deployment_id)
            phase = pb.DeploymentPhase.Name(d.phase) if d else "missing"
            self.errors.append(f"deployment {deployment_id} not terminal within {DEPLOYMENT_BOUND}s: {phase}")

    async def scale(self, env_id: str, replicas: int) -> None:
        def build() -> pb.Environment:
            env = copied(self.watcher.env(env_id))
            env.service.replicas.min = replicas
            return env

        await self.write(build)
        self.stats.scale_changes += 1

    async def set_node(self, node_id: str, status: int, schedulable: bool) -> None:
        def build() -> pb.Node:
            n = copied(self.watcher.node(node_id))
            n.status = status  # type: ignore[assignment]
            n.schedulable = schedulable
            return n

        await self.write(build)

    def volume_node(self) -> str:
        vols = self.watcher.volumes(STATEFUL)
        return vols[0].node_id if vols else ""

    async def drain_and_return(self, node_id: str, timeout: float = 30.0) -> None:
        """Operator drain (DRAINING, cordoned) until the scheduler reports DRAINED, then back in service."""
        self.stats.drains += 1
        await self.set_node(node_id, pb.NODE_STATUS_DRAINING, False)
        with contextlib.suppress(AssertionError):
            await eventually(
                lambda: (n := self.watcher.node(node_id)) is not None and n.status == pb.NODE_STATUS_DRAINED,
                timeout,
                f"{node_id} drained",
            )
            self.stats.drained += 1
        await self.set_node(node_id, pb.NODE_STATUS_ALIVE, True)

    async def kill_agent(self, node_id: str, down_for: float) -> None:
        """The node's agent dies (no reports, no heartbeats), then comes back."""
        self.stats.agent_kills += 1
        self.agent.dead_nodes.add(node_id)
        self.heartbeats.dead.add(node_id)
        await asyncio.sleep(down_for)  # the fault's duration (workload timing, not a timer assertion)
        self.agent.dead_nodes.discard(node_id)
        self.heartbeats.dead.discard(node_id)
        self.agent.poke()

    # ------------------------------------------------------------------ faults

    def leader(self, loop: str) -> Proc | None:
        """The live process that wrote ``lease.<loop>`` within the renew interval (so it leads right now)."""
        pid = self.audit.leader_pid(loop, fresh=LEASE_RENEW * 2)
        proc = self.fleet.procs.get(pid) if pid is not None else None
        return proc if proc is not None and proc.alive() else None

    async def wait_leader(self, loop: str, timeout: float = 30.0) -> Proc:
        await eventually(lambda: self.leader(loop) is not None, timeout, f"a leader of {loop}")
        proc = self.leader(loop)
        assert proc is not None
        return proc

    async def kill_leader(self, loop: str) -> None:
        """SIGKILL the process holding ``lease.<loop>`` and time the takeover (kill → new term's first write)."""
        proc = await self.wait_leader(loop)
        killed_at = time.time()
        self.fleet.kill(proc)
        self.stats.fault(f"sigkill {loop} leader")
        try:
            await eventually(
                lambda: self.audit.first_acquisition_after(loop, killed_at) is not None, 30, f"{loop} takeover"
            )
        except AssertionError:
            self.errors.append(f"no new {loop} leader within 30s of the kill")
            return
        took = self.audit.first_acquisition_after(loop, killed_at)
        assert took is not None
        self.stats.failover_seconds.setdefault(loop, []).append(took - killed_at)

    async def freeze_leader(self, loop: str) -> None:
        """SIGSTOP the leader past its TTL, let a standby take over, SIGCONT: it must step down.

        Which of its checks notices first is a matter of timing: usually its next renewal is refused by
        the server (counted in ``refused_stale_writes``); under load a renewal in flight at the freeze
        times out on resumption and its own TTL check deposes it. Either way no write of the deposed term
        may land, which the fence audit checks at the end.
        """
        proc = await self.wait_leader(loop)
        losses_before = lease_losses(proc.log.read_text(errors="replace"))
        frozen_at = time.time()
        self.fleet.freeze(proc)
        self.stats.fault(f"sigstop {loop} leader")
        try:
            await eventually(
                lambda: (p := self.leader(loop)) is not None and p.pid != proc.pid,
                30,
                f"{loop} taken over from the frozen leader",
            )
        finally:
            self.fleet.thaw(proc)
        took = self.audit.first_acquisition_after(loop, frozen_at)
        if took is not None:
            self.stats.failover_seconds.setdefault(loop, []).append(took - frozen_at)

        def stepped_down() -> bool:
            return lease_losses(proc.log.read_text(errors="replace")) > losses_before

        try:
            await eventually(stepped_down, 20, f"the resumed {loop} leader stepping down")
            self.stats.frozen_leaders_stepped_down += 1
        except AssertionError:
            self.errors.append(f"resumed {loop} leader (pid {proc.pid}) logged no lease loss")

    async def kill_nats_stream_leader(self, down_for: float = 2.0) -> None:
        """SIGKILL the nats-server that leads the state stream; restart it after ``down_for``."""
        index = await self.nats.stream_leader(self.conn)
        self.nats.kill(index)
        self.stats.fault("sigkill nats state-stream leader")
        self.stats.nats_leader_kills += 1
        await asyncio.sleep(down_for)  # outage duration (the fault itself)
        self.nats.restart(index)

    async def random_fault(self) -> str:
        kind = self.rng.choice(["kill", "kill", "kill", "freeze", "nats", "agent"])
        loop = self.rng.choice([loop for loops in LOOPS.values() for loop in loops])
        if kind == "kill":
            await self.kill_leader(loop)
            return f"kill {loop}"
        if kind == "freeze":
            await self.freeze_leader(loop)
            return f"freeze {loop}"
        if kind == "nats":
            await self.kill_nats_stream_leader(self.rng.uniform(1.0, 4.0))
            return "nats"
        node_id = self.rng.choice(WORKERS)
        await self.kill_agent(node_id, self.rng.uniform(1.0, 4.0))
        return f"agent {node_id}"

    # ------------------------------------------------------------------ verdict

    def collect_refusals(self) -> None:
        self.stats.refused_stale_writes = sum(
            refused_stale_writes(p.log.read_text(errors="replace")) for p in self.fleet.procs.values()
        )

    async def lost_acked_writes(self) -> list[str]:
        """Every acknowledged workload write, read back from the stream (direct get of each key's last
        message) through a fresh connection: it must be there at its acknowledged revision or a later one."""
        conn = await connect(self.nats.urls, name="chaos-verify")
        try:
            lost = []
            for key, rev in self.acked.items():
                now = await self._last_rev(conn, key)
                if now < rev or (key.startswith(K.PROJECT + ".") and now != rev):
                    lost.append(f"{key}: acknowledged at {rev}, now {now}")
            return lost
        finally:
            await conn.close()

    async def fresh_view_disagrees(self) -> list[str]:
        """A fresh StateView must load what the stream holds (the view every service starts with)."""
        conn = await connect(self.nats.urls, name="chaos-verify-view")
        view = StateView(conn, name="chaos-verify")
        try:
            await view.start()
            return [f"{k}: view rev {view.rev(k)} < {r}" for k, r in self.acked.items() if view.rev(k) < r]
        finally:
            await view.stop()
            await conn.close()

    @staticmethod
    async def _last_rev(conn: Connection, key: str) -> int:
        for attempt in range(20):
            try:
                msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + key, direct=True)
                return int(msg.seq or 0)
            except NotFoundError:
                return 0
            except Exception:
                await asyncio.sleep(0.1 * (attempt + 1))
        return 0
