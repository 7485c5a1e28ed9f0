"""Chaos harness: a 3-node NATS JetStream cluster, two replicas of every service as real processes, a
fence audit over every message of the state stream, and an invariant-checking view.

* :class:`NatsCluster` — ``shared.embedded.start_cluster``; every bucket and stream provisioned at
  replicas=3; finds the server that leads a stream (``stream_info().cluster.leader``), kills and
  restarts it (same ports, same store).
* :class:`Fleet` — ``python -m services.<name>`` processes with short timers (lease TTL 1 s, renew
  0.3 s …) connected with all three URLs; the pid of each loop's leader is read from ``lease.<loop>``
  (holder ``<service>@<host>:<pid>:<suffix>``); SIGKILL / SIGSTOP / SIGCONT; a killed replica is
  replaced so two stay up.
* :class:`FenceAudit` — an ordered consumer over every message of ``zattera-state`` (not only the last
  per key), with headers. A fenced batch carries its lease re-write (``Lease{holder, term}``) and the
  server keeps ``Nats-Batch-Id`` on every message, so each data write of a leader is attributed to a
  (loop, term) without any change to the services. A term is the revision of its acquiring write, so a
  write of term T is legal only between T and the next term of the same loop: :meth:`FenceAudit.violations`.
* :class:`InvariantWatcher` — a StateView that checks the orchestrator invariants (issue 4 item 4,
  reference §8 I1–I7) at every committed batch boundary it applies, and records every phase seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection, connect
from shared.deployments import is_terminal
from shared.embedded import EmbeddedNats, start_cluster
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.subjects import BUILD_EVENTS_STREAM, LIVE_STREAM, ROUTES_STREAM, STATE_PREFIX, STATE_STREAM
from tests.orchestrator.failover import invariant_violations

ROOT = Path(__file__).resolve().parents[2]

SERVICES = ("scheduler", "orchestrator", "autoscale", "builds", "routes")
LOOPS: dict[str, tuple[str, ...]] = {
    "scheduler": ("scheduler", "liveness", "snapshots"),
    "orchestrator": ("orchestrator",),
    "autoscale": ("autoscaler", "scaletozero", "serverless"),
    "builds": ("builds", "retention"),
    "routes": ("vips",),
}
SERVICE_OF = {loop: service for service, loops in LOOPS.items() for loop in loops}

# Short timers: a takeover takes ~1-2 s, a drain window 1 s, a stuck deployment fails within 20 s.
CHAOS_ENV: dict[str, str] = {
    "ZATTERA_REPLICAS": "3",
    "ZATTERA_LEASE_TTL": "1",
    "ZATTERA_LEASE_RENEW": "0.3",
    "ZATTERA_LOOP_TICK": "2",
    "ZATTERA_SERVERLESS_TICK": "2",
    "ZATTERA_DRAIN_WINDOW": "1",
    "ZATTERA_HEALTH_DEFAULT_GRACE": "5",
    "ZATTERA_HEALTH_DEADLINE_EXTRA": "5",
    "ZATTERA_PLACING_TIMEOUT": "20",
    "ZATTERA_STARTING_TIMEOUT": "20",
    "ZATTERA_STOPPING_OLD_TIMEOUT": "20",
    "ZATTERA_BUILDING_TIMEOUT": "20",
    "ZATTERA_DOMAIN": "chaos.test",
    "PYTHONUNBUFFERED": "1",
}
DEPLOYMENT_BOUND = 60.0
"""Every deployment is terminal within this (its phase timeouts above, plus a failover or two)."""


# ---------------------------------------------------------------------------------------------- NATS

META_LEADER = "meta leader"
CONNECTED_SERVER = "connected server"
NATS_ROLES = (
    META_LEADER,
    f"{STATE_STREAM} leader",
    f"{LIVE_STREAM} leader",
    f"{ROUTES_STREAM} leader",
    f"{BUILD_EVENTS_STREAM} leader",
    CONNECTED_SERVER,
)
"""The servers whose loss issue 26 asks to survive: the JetStream meta leader, each stream's leader, and the
server a client is connected to."""


class NatsCluster:
    """Three local nats-servers as one JetStream cluster (``shared.embedded.start_cluster``)."""

    def __init__(self, base_dir: Path, size: int = 3) -> None:
        self.base_dir = base_dir
        self.size = size
        self.servers: list[EmbeddedNats] = []

    def start(self, running: int | None = None) -> NatsCluster:
        """Every server, or only the first ``running`` (``servers[i].start()`` adds the others later)."""
        self.servers = start_cluster(self.base_dir, self.size, running=running)
        return self

    @property
    def urls(self) -> str:
        return ",".join(s.url for s in self.servers)

    async def provision(self, timeout: float = 60.0) -> None:
        """Every bucket, stream and object store at replicas=3 (retried while the meta leader is elected)."""
        conn = await connect(self.urls, name="chaos-provision")
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await asyncio.wait_for(provision(conn.js, replicas=self.size), 5.0)
                    for stream in (STATE_STREAM, LIVE_STREAM):
                        info = await conn.js.stream_info(stream)
                        if info.cluster is None or not info.cluster.leader:
                            raise RuntimeError(f"{stream} has no leader yet")
                        if any(not peer.current for peer in info.cluster.replicas or []):
                            raise RuntimeError(f"{stream} replicas not current yet")
                    # a consumer can be created (the state view's ordered consumer)
                    probe = await conn.js.subscribe(f"{STATE_PREFIX}>", stream=STATE_STREAM, ordered_consumer=True)
                    await probe.unsubscribe()
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            await conn.close()

    def index_of(self, server_name: str) -> int:
        return next(i for i, s in enumerate(self.servers) if s.name == server_name)

    async def stream_leader(self, conn: Connection, stream: str = STATE_STREAM) -> int:
        info = await conn.js.stream_info(stream)
        assert info.cluster is not None and info.cluster.leader, f"{stream} has no leader"
        return self.index_of(info.cluster.leader)

    def meta_leader(self) -> int:
        """The server leading the JetStream meta group (``/jsz`` of any live server)."""
        for server in self.servers:
            if server.pid is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://{server.host}:{server.http_port}/jsz", timeout=2) as resp:
                    leader = json.loads(resp.read()).get("meta_cluster", {}).get("leader", "")
                if leader:
                    return self.index_of(leader)
        raise RuntimeError("no JetStream meta leader")

    def meta_formed(self) -> bool:
        """Every server is a current member of the JetStream meta group (before it, placing R3 streams is
        refused: "no suitable peers for placement")."""
        for server in self.servers:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://{server.host}:{server.http_port}/jsz", timeout=2) as resp:
                    meta = json.loads(resp.read()).get("meta_cluster", {})
                peers = meta.get("replicas") or []
                if meta.get("leader") and len(peers) == len(self.servers) - 1 and all(p.get("current") for p in peers):
                    return True
        return False

    def connected_to(self, conn: Connection) -> int:
        """The server a client is connected to."""
        url = conn.nc.connected_url
        assert url is not None, "not connected"
        return next(i for i, s in enumerate(self.servers) if s.port == url.port)

    async def server_in_role(self, conn: Connection, role: str) -> int:
        """The server playing ``role`` (one of :data:`NATS_ROLES`) right now."""
        if role == META_LEADER:
            return self.meta_leader()
        if role == CONNECTED_SERVER:
            return self.connected_to(conn)
        return await self.stream_leader(conn, role.removesuffix(" leader"))

    def kill(self, index: int) -> None:
        self.servers[index].kill()

    def restart(self, index: int) -> None:
        self.servers[index].start(wait=30.0)

    def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()


# ---------------------------------------------------------------------------------------------- services


@dataclass
class Proc:
    service: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


def holder_pid(lease: pb.Lease | None) -> int | None:
    if lease is None or not lease.holder:
        return None
    try:
        return int(lease.holder.rsplit(":", 2)[1])  # "<service>@<host>:<pid>:<suffix>"
    except (IndexError, ValueError):
        return None


@dataclass
class Fleet:
    """Service processes of one run; :meth:`stop_all` always leaves nothing behind."""

    urls: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[int, Proc] = field(default_factory=dict)
    started: int = 0

    def start(self, service: str) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started += 1
        log = self.log_dir / f"{service}-{self.started}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                [sys.executable, "-m", f"services.{service}", "--nats", self.urls],
                cwd=ROOT,
                env={**os.environ, **CHAOS_ENV, "ZATTERA_NATS_URL": self.urls, **self.env},
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(service, popen, log)
        self.procs[popen.pid] = proc
        return proc

    def start_all(self, services: tuple[str, ...] = SERVICES, replicas: int = 2) -> None:
        for _ in range(replicas):
            for service in services:
                self.start(service)

    def alive(self, service: str | None = None) -> list[Proc]:
        return [p for p in self.procs.values() if p.alive() and (service is None or p.service == service)]

    def leader(self, view: StateView, loop: str) -> Proc | None:
        pid = holder_pid(view.lease(loop))
        proc = self.procs.get(pid) if pid is not None else None
        return proc if proc is not None and proc.alive() else None

    def kill(self, proc: Proc, *, replace: bool = True) -> Proc | None:
        """SIGKILL (then start a replacement, as a supervisor would)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        return self.start(proc.service) if replace else None

    def freeze(self, proc: Proc) -> None:
        os.kill(proc.pid, signal.SIGSTOP)

    def thaw(self, proc: Proc) -> None:
        os.kill(proc.pid, signal.SIGCONT)

    def crashed(self) -> list[str]:
        """Services that exited on their own (not killed by the harness): a crash."""
        return [
            f"{p.service} pid {p.pid} exited {p.popen.returncode}: {p.log.read_text(errors='replace')[-2000:]}"
            for p in self.procs.values()
            if not p.alive() and p.popen.returncode not in (-signal.SIGKILL, 0)
        ]

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.log.read_text(errors='replace')[-tail:]}" for p in self.procs.values())

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()


def lease_losses(log_text: str) -> int:
    """Every lease loss a process logged, whatever noticed it first (a refused write, or its own TTL)."""
    return sum(1 for line in log_text.splitlines() if " lost (term " in line)


def refused_stale_writes(log_text: str) -> int:
    """Lease losses a deposed leader logged when its renewal or fenced batch was refused by the server."""
    return sum(
        1
        for line in log_text.splitlines()
        if " lost (term " in line and ("renewal refused" in line or "fenced write found the lease taken" in line)
    )


# ---------------------------------------------------------------------------------------------- fence audit


@dataclass(slots=True)
class Landed:
    seq: int
    key: str
    batch: str
    at: float  # server timestamp (epoch seconds)
    loop: str = ""  # set on lease messages
    term: int = -1  # Lease.term of a lease message (0 = the acquiring write, whose term is its seq)
    holder: str = ""


class FenceAudit:
    """Records every message of the state stream with its headers (see the module docstring)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.landed: list[Landed] = []
        self.gaps = 0  # stream sequences never delivered (superseded before delivery, or a consumer reset)
        self._last_seq = 0
        self._sub: object | None = None
        self.acquired: dict[str, list[tuple[int, float]]] = defaultdict(list)  # loop -> [(term, server time)]
        self.last_lease: dict[str, Landed] = {}
        # loop -> term -> server time of the first message of that term seen (the acquiring write, or the
        # first re-write when the acquiring one was superseded before delivery)
        self.term_seen_at: dict[str, dict[int, float]] = defaultdict(dict)

    async def start(self) -> FenceAudit:
        self._sub = await self._conn.js.subscribe(
            f"{STATE_PREFIX}>",
            stream=STATE_STREAM,
            cb=self._on_msg,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=512 * 1024 * 1024,
        )
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]

    async def _on_msg(self, msg: Msg) -> None:
        try:
            meta = msg.metadata
        except Exception:
            return
        seq = meta.sequence.stream
        if seq <= self._last_seq:
            return
        if self._last_seq and seq > self._last_seq + 1:
            self.gaps += seq - self._last_seq - 1
        self._last_seq = seq
        headers = msg.headers or {}
        key = msg.subject[len(STATE_PREFIX) :]
        at = meta.timestamp.timestamp() if meta.timestamp else time.time()
        landed = Landed(seq, key, headers.get("Nats-Batch-Id", ""), at)
        if key.startswith(K.LEASE + ".") and headers.get("KV-Operation") is None and msg.data:
            with contextlib.suppress(Exception):
                lease = pb.Lease.FromString(msg.data)
                landed.loop = key[len(K.LEASE) + 1 :]
                landed.term = lease.term
                landed.holder = lease.holder
                self.term_seen_at[landed.loop].setdefault(lease.term or seq, at)
                if lease.term == 0:  # an acquisition in progress: nobody leads until its second write
                    self.acquired[landed.loop].append((seq, at))
                    self.last_lease.pop(landed.loop, None)
                else:
                    self.last_lease[landed.loop] = landed
        self.landed.append(landed)

    def leader_pid(self, loop: str, fresh: float) -> int | None:
        """The pid holding ``lease.<loop>`` now: the writer of its newest lease message, if younger than ``fresh``
        (a view may still show a lease that expired while a NATS server was down)."""
        last = self.last_lease.get(loop)
        if last is None or time.time() - last.at > fresh:
            return None
        return holder_pid(pb.Lease(holder=last.holder))

    def terms(self, loop: str) -> list[int]:
        seen = {t for t, _ in self.acquired[loop]}
        seen.update(m.term for m in self.landed if m.loop == loop and m.term > 0)
        return sorted(seen)

    def fenced_batches(self) -> dict[str, list[Landed]]:
        """batch id -> messages, for batches that carry a lease re-write (a leader's fenced batch)."""
        batches: dict[str, list[Landed]] = defaultdict(list)
        for m in self.landed:
            if m.batch:
                batches[m.batch].append(m)
        return {b: ms for b, ms in batches.items() if any(m.loop for m in ms)}

    def violations(self) -> list[str]:
        """Writes that landed outside their term's window [T, next term of the same loop)."""
        problems: list[str] = []
        terms = {loop: self.terms(loop) for loop in {m.loop for m in self.landed if m.loop}}
        for m in self.landed:
            if not m.loop or m.term <= 0:
                continue
            later = [t for t in terms[m.loop] if t > m.term]
            if m.seq < m.term or (later and m.seq >= later[0]):
                problems.append(f"lease.{m.loop} write of term {m.term} landed at {m.seq} (next term {later[:1]})")
        for batch, msgs in self.fenced_batches().items():
            lease = next(m for m in msgs if m.loop)
            seqs = sorted(m.seq for m in msgs)
            if seqs != list(range(seqs[0], seqs[0] + len(seqs))):
                problems.append(f"fenced batch {batch} of lease.{lease.loop} not contiguous: {seqs}")
            later = [t for t in terms[lease.loop] if t > lease.term]
            if later and seqs[-1] >= later[0]:
                problems.append(f"batch {batch} of term {lease.term} of {lease.loop} landed after term {later[0]}")
        return problems

    def counts(self) -> dict[str, int]:
        batches = self.fenced_batches()
        return {
            "messages": len(self.landed),
            "fenced_batches": len(batches),
            "fenced_data_writes": sum(sum(1 for m in ms if not m.loop) for ms in batches.values()),
            "terms": sum(len(self.terms(loop)) for loop in {m.loop for m in self.landed if m.loop}),
            "gaps": self.gaps,
        }

    def first_acquisition_after(self, loop: str, t: float) -> float | None:
        """Server time of the first acquisition of ``loop`` at or after epoch time ``t``."""
        times = [at for at in self.term_seen_at[loop].values() if at >= t]
        return min(times) if times else None


# ---------------------------------------------------------------------------------------------- invariants


class InvariantWatcher(StateView):
    """Checks the invariants at every committed batch boundary it applies (a lease re-write ends every
    leader batch; an agent report is a single write) and records the phases each deployment went through."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, name="chaos-invariants")
        self.violations: list[str] = []
        self.checks = 0
        self.phases_seen: dict[str, list[int]] = {}
        self.terminal_at: dict[str, float] = {}

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
                if is_terminal(d.phase):
                    self.terminal_at.setdefault(ident, time.monotonic())
        if kind in (K.LEASE, K.OBSERVED):
            self.check()

    def check(self) -> None:
        self.checks += 1
        found = invariant_violations(self)
        if found and len(self.violations) < 50:
            self.violations.extend(f"[check {self.checks}] {v}" for v in found)
