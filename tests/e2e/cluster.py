"""End-to-end harness: the whole control plane as real processes on a real embedded NATS.

:class:`E2ECluster` reuses ``cli.up_cluster.Cluster`` (embedded nats-server, every service as its own process,
logs under ``<root>/logs``) and adds two node agents (``n1`` is the builder) and one ingress proxy on a
free port. Timers are shortened through ``ZATTERA_*`` variables (:data:`FAST_TIMERS`) so a deploy, a
drain, a cool-down or a node loss takes seconds; every wait is a condition (``tests.waiting.eventually``),
never a sleep standing in for a timer. Spans go to ``<root>/traces.jsonl`` (``OTEL_TRACES_EXPORTER=file``).

:meth:`E2ECluster.stop` stops the services (SIGTERM, then SIGKILL), then sweeps every process whose
working directory is under ``root`` (app instances an agent killed with SIGKILL left behind) or whose
command line names this cluster's NATS URL: nothing outlives a test.

Helpers: :meth:`cli` runs the real ``zattera`` command as a subprocess; :meth:`state` opens a
connection with a started :class:`StateView`; :meth:`get` sends one request through the proxy;
:class:`Load` sends a steady stream of requests and records every failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.layout import DataLayout
from cli.supervised import Supervised
from cli.up_cluster import Cluster
from services.proxy.settings import ROUTES_CACHE_FILE
from shared.connection import Connection, connect
from shared.embedded import free_port
from shared.routeclient import RouteClient, load_cached
from shared.security.permissions import Role
from shared.security.setup import SecureSetup, prepare
from shared.state.feed import StateView
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hello"
NODES = ("n1", "n2")
BUILDER = "n1"
LOOPS = ("scheduler", "liveness", "orchestrator", "autoscaler", "scaletozero", "serverless", "builds", "vips")

FAST_TIMERS: dict[str, str] = {
    "ZATTERA_DOMAIN": "localhost",
    "ZATTERA_LOOP_TICK": "1",
    "ZATTERA_SERVERLESS_TICK": "1",
    "ZATTERA_DRAIN_WINDOW": "1.5",
    "ZATTERA_NODE_HEARTBEAT_DEADLINE": "4",
    "ZATTERA_LIVENESS_GRACE": "2",
    "ZATTERA_AGENT_HEARTBEAT_INTERVAL": "0.5",
    "ZATTERA_AGENT_RECONCILE_TICK": "1",
    "ZATTERA_AGENT_RESTART_BACKOFF": "0.2",
    "ZATTERA_AGENT_DEFAULT_STOP_GRACE": "3",
    "ZATTERA_AGENT_MIN_HEALTHY_TIME": "1",
    "ZATTERA_PROXY_HEARTBEAT_INTERVAL": "0.5",
    "ZATTERA_PROXY_HOLD_TIMEOUT": "30",
    "ZATTERA_PROXY_SHUTDOWN_GRACE": "1",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
    "PYTHONUNBUFFERED": "1",
    "COLUMNS": "200",
}


def cli_argv() -> list[str]:
    """The installed ``zattera`` console script, else the module through this interpreter."""
    script = Path(sys.executable).parent / "zattera"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from cli.main import main; main()"]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _ours(proc: psutil.Process, root: str, token: str) -> bool:
    """Works under ``root``, or names ``token`` (the cluster's NATS URL, its data dir) as an argument."""
    cwd = proc.info.get("cwd") or ""
    argv = proc.info.get("cmdline") or []
    return _under(cwd, root) or bool(token and any(arg == token or _under(arg, token) for arg in argv))


def kill_tree_under(root: Path, *, also_matching: str = "") -> list[int]:
    """SIGKILL every process working under ``root`` (or with ``also_matching`` as an argument), and what runs
    below it (a sandboxed instance's processes would outlive their bwrap)."""
    killed: list[psutil.Process] = []
    me = os.getpid()
    prefix = str(root.resolve())
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        if proc.info["pid"] == me or not _ours(proc, prefix, also_matching):
            continue
        with contextlib.suppress(psutil.Error):
            for member in [*proc.children(recursive=True), proc]:
                with contextlib.suppress(psutil.Error):
                    member.kill()
                    killed.append(member)
    psutil.wait_procs(killed, timeout=5)
    return [p.pid for p in killed]


def leftovers(root: Path, *, also_matching: str = "") -> list[str]:
    """Processes still working under ``root`` (or naming ``also_matching``): a clean stop leaves none."""
    found = []
    prefix = str(root.resolve())
    for proc in psutil.process_iter(["pid", "cwd", "cmdline", "status"]):
        if proc.info.get("status") == psutil.STATUS_ZOMBIE or not _ours(proc, prefix, also_matching):
            continue
        found.append(f"{proc.info['pid']} {' '.join(proc.info.get('cmdline') or [])} (cwd {proc.info.get('cwd')})")
    return found


class _E2EUp(Cluster):
    """``cli.up_cluster.Cluster`` with the harness's timers in every child's environment."""

    overrides: dict[str, str]

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        env.update(self.overrides)
        return env


@dataclass
class E2ECluster:
    root: Path
    nodes: tuple[str, ...] = NODES
    builder: str = BUILDER
    timers: Mapping[str, str] = field(default_factory=dict)
    mesh_ips: Mapping[str, str] = field(default_factory=dict)
    """node -> its agent's ``--mesh-ip`` (unset: none, i.e. 127.0.0.1)."""
    trace: bool = True
    proxy_port: int = 0
    python_proxy: bool = False
    """Also run a proxy of the Python engine (``p2``, on ``python_proxy_port``; ``get(..., port=)`` reaches it)."""
    python_proxy_port: int = 0
    metrics: bool = False
    """Every process serves Prometheus metrics (ports in ``up.metrics_ports``, by process name)."""
    secure: bool = False
    """As ``zattera up --secure``: role accounts, the join service, each process with its own credential."""
    security: SecureSetup | None = None
    up: _E2EUp | None = None
    killed: set[str] = field(default_factory=set)
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        assert self.up is not None
        return self.up.url

    @property
    def trace_file(self) -> Path:
        return self.root / "traces.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def env(self) -> dict[str, str]:
        env = {**FAST_TIMERS, **self.timers}
        if self.trace:
            env["OTEL_TRACES_EXPORTER"] = "file"
            env["ZATTERA_TRACE_FILE"] = str(self.trace_file)
        else:
            env["OTEL_TRACES_EXPORTER"] = "none"
        return env

    def start(self) -> E2ECluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.proxy_port = self.proxy_port or free_port()
        # One process per service: tests scrape and kill services one by one (tests/e2e/test_up.py runs the
        # all-in-one default through the real `zattera up`).
        up = _E2EUp(
            data_dir=self.root,
            port=0,
            with_node=False,
            metrics_port=free_port() if self.metrics else 0,
            all_in_one=False,
        )
        if self.secure:
            self.security = prepare(DataLayout(self.root).security)  # where the join service reads it
            up.nats_extra_config = self.security.server_config()
            up.creds = str(self.security.control_creds)
        up.overrides = self.env()
        self.up = up
        up.start_nats()
        asyncio.run(_provision(up.url, up.creds))
        up.extra = [self._agent(node) for node in self.nodes] + [self._proxy()]
        if self.python_proxy:
            self.python_proxy_port = self.python_proxy_port or free_port()
            up.extra.append(self._proxy("p2", self.python_proxy_port, "--engine", "python"))
        if self.security is not None:
            up.extra.append(Supervised("join", [sys.executable, "-m", "services.join"], self.logs / "join.log", {}))
        up.start_services()
        self._stopping.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="e2e-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        """Restart a child that died (as ``zattera up`` does, logged in its log), except one killed on purpose."""
        while not self._stopping.wait(0.2):
            up = self.up
            if up is None:
                return
            live = [c for c in up.children if c.name not in self.killed]
            dead = [c.name for c in live if not c.alive() and c.next_start == 0.0]
            saved, up.children = up.children, live
            try:
                up.supervise_once()
            finally:
                up.children = saved
            for name in dead:
                with contextlib.suppress(OSError), open(self.logs / f"{name}.log", "a") as log:
                    log.write(f"e2e harness: {name} exited; restarting it\n")

    def _agent(self, node: str) -> Supervised:
        argv = [
            sys.executable,
            "-m",
            "services.agent",
            "--nats",
            self.url,
            "--node-id",
            node,
            "--data-dir",
            str(self.root / f"agent-{node}"),
            "--stop-on-exit",
        ]
        if node == self.builder:
            argv.append("--builder")
        if node in self.mesh_ips:
            argv += ["--mesh-ip", self.mesh_ips[node]]
        assert self.up is not None
        argv += self.up.metrics_args(f"agent-{node}")
        return Supervised(
            f"agent-{node}", argv, self.logs / f"agent-{node}.log", self._creds_env(self._role(node), node)
        )

    def _role(self, node: str) -> Role:
        return Role.BUILDER if node == self.builder else Role.AGENT

    def _creds_env(self, role: Role, name: str) -> dict[str, str]:
        """A secured cluster's process of ``role`` gets a credential of its own (never the control one)."""
        return {"ZATTERA_NATS_CREDS": str(self.security.creds(role, name))} if self.security else {}

    def _proxy(self, proxy_id: str = "p1", port: int = 0, *flags: str) -> Supervised:
        name = "proxy" if proxy_id == "p1" else f"proxy-{proxy_id}"
        argv = [
            sys.executable,
            "-m",
            "services.proxy",
            "--nats",
            self.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port or self.proxy_port),
            "--proxy-id",
            proxy_id,
            "--node-id",
            self.nodes[0],
            "--cache-dir",
            str(self.root / name),
            *flags,
        ]
        assert self.up is not None
        argv += self.up.metrics_args(name)
        return Supervised(name, argv, self.logs / f"{name}.log", self._creds_env(Role.PROXY, proxy_id))

    def child(self, name: str) -> Supervised:
        assert self.up is not None
        return next(c for c in self.up.children if c.name == name)

    def stop(self) -> None:
        if self.up is None:
            return
        url = self.up.url if self.up.nats is not None else ""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
        try:
            self.up.stop(grace=10.0)
        finally:
            kill_tree_under(self.root, also_matching=url)
            self.up = None

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Every node ALIVE, every leader loop held, the proxy answering, a route snapshot published."""
        async with self.state() as (conn, view):
            await eventually(
                lambda: all(
                    (n := view.node(node)) is not None and n.status == pb.NODE_STATUS_ALIVE for node in self.nodes
                ),
                timeout,
                "every node registered and ALIVE",
            )
            await eventually(lambda: all(view.lease(loop) is not None for loop in LOOPS), timeout, "leases held")
            await eventually(lambda: self._routes_answer(conn), timeout, "a route snapshot is served")
        await eventually(self._proxy_answers, timeout, "the proxy answers")

    async def _routes_answer(self, conn: Connection) -> bool:
        return await route_snapshot(conn) is not None

    async def _proxy_answers(self) -> bool:
        try:
            status, _ = await self.get("nothing.invalid", timeout=2.0)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return status == 404

    # ------------------------------------------------------------------ processes

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a child (its whole process group) and keep it from being restarted."""
        child = self.child(name)
        assert child.proc is not None
        self.killed.add(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, sig)
        child.proc.wait(10)

    def instance_pids(self, node: str) -> list[int]:
        """The app processes an agent left under its data dir (by their working directory)."""
        prefix = str((self.root / f"agent-{node}").resolve())
        return [p.info["pid"] for p in psutil.process_iter(["pid", "cwd"]) if _under(p.info.get("cwd") or "", prefix)]

    def log_tail(self, lines: int = 40) -> str:
        """The end of every log (for failure messages)."""
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()
            parts.append(f"==> {path.name} <==\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    # ------------------------------------------------------------------ operator side

    def cli(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``zattera ARGS`` against this cluster (a real subprocess)."""
        done = subprocess.run(
            [*cli_argv(), *args],
            cwd=ROOT,
            env=self.cli_env(),
            stdin=subprocess.DEVNULL,  # no terminal, as in a script: confirmations need --yes
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"zattera {' '.join(args)} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        return done

    def cli_env(self) -> dict[str, str]:
        """The environment of a CLI run against this cluster (the operator credential when secured)."""
        env = {**os.environ, **self.env(), "ZATTERA_NATS_URL": self.url, "ZATTERA_DATA_DIR": str(self.root)}
        if self.security is not None:
            env["ZATTERA_NATS_CREDS"] = str(self.security.operator_creds)
        return env

    async def acli(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """:meth:`cli` without blocking the event loop (load generators keep running meanwhile)."""
        return await asyncio.to_thread(self.cli, *args, timeout=timeout, check=check)

    @contextlib.asynccontextmanager
    async def state(self) -> AsyncIterator[tuple[Connection, StateView]]:
        creds = str(self.security.control_creds) if self.security else None
        conn = await connect(self.url, name="e2e-test", creds=creds)
        view = StateView(conn, name="e2e")
        try:
            await view.start()
            yield conn, view
        finally:
            # Bounded: a test failing inside must report its own error, not hang in the client's teardown.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(view.stop(), 10)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.close(), 10)

    async def get(self, host: str, path: str = "/", timeout: float = 10.0, port: int = 0) -> tuple[int, str]:
        """One request through the proxy (``port``: another proxy of this cluster, e.g. ``python_proxy_port``)."""
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(f"http://127.0.0.1:{port or self.proxy_port}{path}", headers={"Host": host}) as response,
        ):
            return response.status, await response.text()

    def proxy_routes_version(self, proxy_id: str = "p1") -> int:
        """The route snapshot version a proxy holds (its cache file, written as it accepts a snapshot)."""
        name = "proxy" if proxy_id == "p1" else f"proxy-{proxy_id}"
        return load_cached(self.root / name / ROUTES_CACHE_FILE).version

    def spans(self) -> list[dict[str, Any]]:
        if not self.trace_file.exists():
            return []
        out = []
        for line in self.trace_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


async def _provision(url: str, creds: str = "") -> None:
    from shared.provisioning import provision

    conn = await connect(url, name="e2e-provision", creds=creds or None)
    try:
        await provision(conn.js)
    finally:
        await conn.close()


async def route_snapshot(conn: Connection, timeout: float = 3.0) -> cpb.RouteSnapshot | None:
    """The current route snapshot, fetched the way a proxy does (``zattera.routes.get``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        client = RouteClient(Path(tmp) / "routes.pb")
        await client.start(conn)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if client.version or await client.fetch():
                    return client.current
                await asyncio.sleep(0.05)
            return client.current if client.version else None
        finally:
            await client.stop()


# ---------------------------------------------------------------------------------------------- apps


def app_source(dest: Path, version: str) -> Path:
    """A copy of examples/hello whose default version string is ``version``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("app.py", "zattera.toml"):
        text = (EXAMPLE / name).read_text()
        if name == "app.py":
            text = re.sub(r'"HELLO_VERSION", "[^"]*"', f'"HELLO_VERSION", "{version}"', text)
        (dest / name).write_text(text)
    return dest


def version_of(body: str) -> str:
    try:
        return str(json.loads(body).get("version", ""))
    except ValueError:
        return ""


def env_by_name(view: StateView, name: str) -> pb.Environment | None:
    return next((e for e in view.envs() if e.name == name), None)


def healthy(view: StateView, env_id: str, release_id: str = "") -> list[pb.Assignment]:
    return [
        a
        for a in view.assignments(env_id)
        if a.desired == pb.ASSIGNMENT_DESIRED_RUN
        and a.observed.state == pb.INSTANCE_STATE_HEALTHY
        and (not release_id or a.release_id == release_id)
    ]


def running(view: StateView, env_id: str) -> list[pb.Assignment]:
    return [a for a in view.assignments(env_id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN]


# ---------------------------------------------------------------------------------------------- load


@dataclass
class Load:
    """Requests at a steady ``rate`` through the proxy until stopped; every failure is recorded.

    A failure is any non-200 answer or any client error. Requests are issued on a schedule (not one after
    the other), bounded by ``max_inflight`` so a stall shows up as failures, not as an unbounded pile.
    """

    port: int
    host: str
    rate: float = 60.0
    timeout: float = 10.0
    max_inflight: int = 200
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    versions: Counter[str] = field(default_factory=Counter)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    started_at: float = 0.0
    stopped_at: float = 0.0

    @property
    def sent(self) -> int:
        return self.ok + len(self.failures)

    def start(self) -> Load:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> Load:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self

    async def _run(self) -> None:
        self.started_at = time.monotonic()
        interval = 1.0 / self.rate
        inflight: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout)
        ) as session:
            next_at = time.monotonic()
            while not self._stop.is_set():
                if len(inflight) < self.max_inflight:
                    task = asyncio.create_task(self._one(session))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                else:
                    self.failures.append(f"{time.time():.3f} client: {self.max_inflight} requests in flight")
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
        self.stopped_at = time.monotonic()

    async def _one(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(f"http://127.0.0.1:{self.port}/", headers={"Host": self.host}) as response:
                body = await response.text()
                if response.status == 200:
                    self.ok += 1
                    self.versions[version_of(body)] += 1
                else:
                    self.failures.append(f"{time.time():.3f} HTTP {response.status}: {body[:200]}")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.failures.append(f"{time.time():.3f} {exc!r}")

    def rate_achieved(self) -> float:
        end = self.stopped_at or time.monotonic()
        return self.sent / max(end - self.started_at, 1e-9)

    def summary(self) -> str:
        head = self.failures[:20]
        return (
            f"{self.sent} sent ({self.rate_achieved():.0f}/s), {self.ok} ok, {len(self.failures)} failed, "
            f"versions {dict(self.versions)}" + ("\n" + "\n".join(head) if head else "")
        )


def spans_of_trace(spans: Iterable[dict[str, Any]], trace_id: str) -> list[dict[str, Any]]:
    return [s for s in spans if s.get("trace_id") == trace_id]
