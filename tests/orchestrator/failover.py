"""Failover harness: real orchestrator processes (``python -m services.orchestrator``) on one NATS server,
a leader killed with SIGKILL mid-deployment, and the chaos invariants checked at every observed state.

"Every observed state" = every committed batch boundary the test's view sees: an orchestrator batch ends
with its lease re-write, an agent report is a single write, so the invariants are checked whenever the
view applies a lease or an observed key (never in the middle of a batch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from shared.deployments import is_terminal
from shared.state.feed import StateView
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
RUN = pb.ASSIGNMENT_DESIRED_RUN
PROMOTED = frozenset({pb.DEPLOYMENT_PHASE_DRAINING_OLD, pb.DEPLOYMENT_PHASE_SUCCEEDED})

# Short timers so a takeover (lease TTL) and a drain take about a second each.
PROCESS_ENV = {
    "ZATTERA_LEASE_TTL": "1",
    "ZATTERA_LEASE_RENEW": "0.2",
    "ZATTERA_LOOP_TICK": "1",
    "ZATTERA_DRAIN_WINDOW": "1",
}


def invariant_violations(view: StateView) -> list[str]:
    """The reference's chaos invariants I1–I7 over one consistent state."""
    problems: list[str] = []
    releases = {r.meta.id: r for r in view.releases()}
    for env in view.envs():
        if env.active_release_id and env.active_release_id not in releases:
            problems.append(f"I1 env {env.meta.id}: active release {env.active_release_id} missing")
    stateful_run: dict[str, int] = {}
    for a in view.assignments():
        if a.desired != RUN:
            continue
        rel = releases.get(a.release_id)
        if rel is None:
            problems.append(f"I2 assignment {a.meta.id}: release {a.release_id} missing")
        if view.node(a.node_id) is None:
            problems.append(f"I3 assignment {a.meta.id}: node {a.node_id} missing")
        if rel is not None and rel.service.stateful:
            stateful_run[a.environment_id] = stateful_run.get(a.environment_id, 0) + 1
    problems += [f"I4 env {e}: {n} RUN stateful instances" for e, n in stateful_run.items() if n > 1]
    for env in view.envs():
        deployments = view.deployments(env.meta.id)
        if not deployments:
            continue
        latest = deployments[-1]
        promoted = latest.phase in PROMOTED
        if promoted != (env.active_release_id == latest.release_id):
            problems.append(
                f"I5/I6 deployment {latest.meta.id} {pb.DeploymentPhase.Name(latest.phase)}: "
                f"active release {env.active_release_id!r}, target {latest.release_id!r}"
            )
    for d in view.deployments():
        if d.phase == pb.DEPLOYMENT_PHASE_FAILED and any(
            a.deployment_id == d.meta.id and a.desired == RUN for a in view.assignments(d.environment_id)
        ):
            problems.append(f"I7 failed deployment {d.meta.id} still has RUN green")
    return problems


class InvariantView(StateView):
    """A view that checks the invariants at every batch boundary it applies and records phases seen."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, name="invariants")
        self.violations: list[str] = []
        self.checks = 0
        self.phases_seen: dict[str, list[int]] = {}

    def _notify(self, kind: str, ident: str) -> None:
        super()._notify(kind, ident)
        if self.stale:
            return
        if kind == K.DEPLOYMENT:
            d = self.deployment(ident)
            if d is not None:
                seen = self.phases_seen.setdefault(ident, [])
                if not seen or seen[-1] != d.phase:
                    seen.append(d.phase)
        if kind in (K.LEASE, K.OBSERVED):
            self.checks += 1
            if len(self.violations) < 20:
                self.violations.extend(invariant_violations(self))


def holder_pid(view: StateView) -> int | None:
    lease = view.lease("orchestrator")
    if lease is None or not lease.holder:
        return None
    return int(lease.holder.rsplit(":", 2)[1])  # "orchestrator@<host>:<pid>:<suffix>"


class Orchestrators:
    """Orchestrator processes for one test; always cleaned up by :meth:`stop_all`."""

    def __init__(self, nats_url: str, log_dir: Path) -> None:
        self.nats_url = nats_url
        self.log_dir = log_dir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.log_of: dict[int, Path] = {}

    def start(self) -> int:
        log = self.log_dir / f"orchestrator-{len(self.procs)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.orchestrator", "--nats", self.nats_url, "--log-level", "INFO"],
                cwd=ROOT,
                env={**os.environ, **PROCESS_ENV},
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        self.procs[proc.pid] = proc
        self.log_of[proc.pid] = log
        return proc.pid

    async def wait_running(self, timeout: float = 120.0) -> None:
        """Until every process started has said it runs (its interpreter, imports and NATS connection done):
        on a busy machine that takes longer than any failover this suite measures, and must not count in it."""

        def all_running() -> bool:
            return all(": running (" in log.read_text(errors="replace") for log in self.log_of.values())

        await eventually(all_running, timeout, "every orchestrator process running")

    def alive(self) -> list[int]:
        return [pid for pid, p in self.procs.items() if p.poll() is None]

    async def wait_leader(self, view: StateView, *, other_than: int | None = None, timeout: float = 20.0) -> int:
        def led() -> bool:
            pid = holder_pid(view)
            return pid is not None and pid != other_than and pid in self.alive()

        await eventually(led, timeout, "an orchestrator process holds the lease")
        pid = holder_pid(view)
        assert pid is not None
        return pid

    def freeze(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)

    def thaw(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)

    def log(self, pid: int) -> str:
        return self.log_of[pid].read_text(errors="replace")

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.procs[pid].wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.log_dir.glob("orchestrator-*.log")))

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def is_done(view: StateView, deployment_id: str) -> bool:
    d = view.deployment(deployment_id)
    return d is not None and is_terminal(d.phase)
