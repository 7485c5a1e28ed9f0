"""``zattera up``: the whole single-machine cluster on the embedded NATS server.

Starts nats-server (JetStream, data under ``<data_dir>/control/nats``), provisions the buckets and streams,
then the control plane — every service in one process (``cli.control_plane``, the default), or each service
as its own process (``--separate``) — and the local node (logs under ``<data_dir>/logs``), restarts a service or a NATS
server that dies (with backoff), and on Ctrl-C / SIGTERM stops the services (SIGTERM, then SIGKILL after a grace) and
then NATS, leaving no process behind. Running it again resumes the same cluster from its data dir. The control
plane, the local agent and the local proxy each keep their files in a directory of their own
(``cli/layout.py``): the agent is given its own credential, never a path into the control plane's files.

Run while a supervisor of the same data dir runs (``git pull && make up``), it asks that supervisor (its pid
in ``<data_dir>/up.pid``, locked while it lives) to roll its processes onto the code now installed:
migrations first, then each process stopped and started again, one at a time, the agent's instances kept
(docs/upgrades.md); it prints the supervisor's progress and exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from rich.console import Console
from rich.markup import escape

from cli.layout import NATS_CA, DataLayout
from services.proxy.launch import DEFAULT_HOST as DEFAULT_PROXY_HOST
from services.proxy.launch import choose_engine, split_listen
from shared.backoff import exponential
from shared.embedded import EmbeddedNats, EmbeddedNatsError, RouteSecurity, free_port, start_cluster
from shared.runtime_note import RUNTIME_NOTE, RuntimeNote, read_runtime_note
from shared.subprocesses import spawn_logged

SERVICES = ("scheduler", "orchestrator", "autoscale", "builds", "routes", "secrets", "certs", "console")
ALL_IN_ONE = "control-plane"
"""The process that runs every service of ``cli.control_plane`` (``join`` included: idle unless secured)."""
ALL_IN_ONE_SERVICES = frozenset((*SERVICES, "join"))
LOCAL_NODE = "local"
CONTROL_ONLY_SETTINGS = tuple(sorted(f"ZATTERA_{name.upper()}_" for name in ALL_IN_ONE_SERVICES))
"""The control-plane services' own variables (``ZATTERA_SECRETS_KEY``: the cluster key): never given to the
local agent or proxy."""
DEFAULT_METRICS_PORT = 9400
RESTART_FIRST = 0.5
"""Seconds before a process that died is started again; doubling per restart within a minute of its start."""
RESTART_MOST = 30.0
"""``zattera up``'s first metrics port: scheduler 9400, orchestrator 9401, … in start order."""
PROJECT_ROOT = Path(__file__).resolve().parents[1]
PID_FILE = "up.pid"
"""``<data_dir>/up.pid``: the running supervisor's pid, locked (``flock``) for as long as it lives."""
ROLL_LOG = "up-roll.log"
"""``<data_dir>/up-roll.log``: the progress of the last roll, which the requesting ``zattera up`` prints."""
ROLL_SIGNAL = signal.SIGUSR1
"""Sent to the supervisor: roll every process onto the code installed now."""
RESTART_SIGNAL = signal.SIGUSR2
"""Sent to one process: stop to be started again at once (``shared.process.RESTART_SIGNAL``; not imported:
the supervisor loads no asyncio)."""
ROLL_DONE, ROLL_REFUSED = "done:", "refused:"
CODE_DIRS = ("shared", "services", "cli", "proto")


def available_services() -> list[str]:
    return [s for s in SERVICES if (PROJECT_ROOT / "services" / s / "__main__.py").exists()]


@dataclass
class Supervised:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0

    def start(self, *, die_with_parent: bool = False) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = spawn_logged(
            self.argv, self.log_path, cwd=PROJECT_ROOT, env=self.env, die_with_parent=die_with_parent
        )
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def started_since(self, offset: int) -> bool:
        """Its log, past ``offset``, says that it started (``<name>: Zattera <version> (schema N) starting``)."""
        if not self.log_path.exists():
            return False
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return b": Zattera " in log.read() and self.alive()

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Cluster:
    data_dir: Path
    port: int = 4222
    proxy_port: int = 8080
    proxy_host: str = DEFAULT_PROXY_HOST
    # HOST:PORT of the proxy's TLS listener (haproxy engine; a free port when busy); '' = none, unless asked
    # (tests, embedders): `zattera up` asks for DEFAULT_PROXY_TLS_LISTEN.
    proxy_tls_listen: str = ""
    console_port: int = 8090  # the web console's (docs/console.md); a free one when busy
    with_node: bool = True
    services: list[str] = field(default_factory=available_services)
    # The control plane as one process (``cli.control_plane``); False: one process per service.
    all_in_one: bool = True
    extra: list[Supervised] = field(default_factory=list)
    # soft_wrap: the banner's lines (an `export …CREDS=<path>` to copy) are never cut at 80 columns in a pipe.
    console: Console = field(default_factory=lambda: Console(stderr=True, soft_wrap=True))
    nats: EmbeddedNats | None = None
    # ``--nats-cluster N``: N local servers as one JetStream cluster, every bucket and stream at replicas=N.
    nats_cluster: int = 1
    # Every process started gets SIGTERM when the one that started it dies, however it dies: `zattera up`'s
    # supervisor (single-threaded) sets it; tests and embedders that start children from threads do not.
    die_with_parent: bool = False
    cluster_servers: list[EmbeddedNats] = field(default_factory=list)
    children: list[Supervised] = field(default_factory=list)
    nats_restarts: dict[str, int] = field(default_factory=dict)
    nats_next_start: dict[str, float] = field(default_factory=dict)
    # Secured clusters (cli/security_cmds.py): server auth/TLS config, and the services' credentials.
    nats_extra_config: str = ""
    # A secured cluster's route credential and route TLS (``RouteSecurity`` as a dict; empty: open routes).
    nats_routes: dict[str, str] = field(default_factory=dict)
    creds: str = ""
    tls_ca: str = ""
    # The local node's own credentials ("agent", "proxy" → creds file): never the services' control one.
    node_creds: dict[str, str] = field(default_factory=dict)
    # ``--metrics-port BASE``: each process serves Prometheus metrics on the next port from BASE (a busy one
    # is replaced by a free one); 0 = off. ``metrics_ports`` maps each process name to its port.
    metrics_port: int = 0
    metrics_ports: dict[str, int] = field(default_factory=dict)
    @property
    def layout(self) -> DataLayout:
        return DataLayout(self.data_dir)

    # One machine of a cluster of machines (cli/machine.py): its node id, its NATS server (a route member,
    # or none on a worker, which uses ``machine["servers"]``), the agent's flags and the services' settings.
    node_id: str = LOCAL_NODE
    machine: dict[str, Any] = field(default_factory=dict)
    runtime_note: RuntimeNote | None = None
    """The local agent's runtime and why, as last printed (:meth:`report_runtime`)."""
    # What the processes run: :func:`code_identity` when they were started (a roll onto the same is a no-op).
    code: str = ""

    def config(self) -> dict[str, Any]:
        """What the cluster was asked to be (not what runs), as JSON values: :meth:`from_config` reads it."""
        extra = [{"name": c.name, "argv": c.argv, "log_path": str(c.log_path), "env": c.env} for c in self.extra]
        given = {name: getattr(self, name) for name in CONFIG_FIELDS}
        return {**given, "data_dir": str(self.data_dir), "extra": extra}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Cluster:
        extra = [Supervised(e["name"], e["argv"], Path(e["log_path"]), e["env"]) for e in config["extra"]]
        given = {name: config[name] for name in CONFIG_FIELDS}
        return cls(data_dir=Path(config["data_dir"]), extra=extra, **given)

    def metrics_args(self, name: str) -> list[str]:
        """``--metrics-port N`` for process ``name`` (nothing when metrics are off)."""
        if not self.metrics_port:
            return []
        if name not in self.metrics_ports:
            wanted = self.metrics_port + len(self.metrics_ports)
            taken = set(self.metrics_ports.values())
            self.metrics_ports[name] = wanted if wanted not in taken and _port_free(wanted) else free_port()
        return ["--metrics-port", str(self.metrics_ports[name])]

    @property
    def url(self) -> str:
        if self.cluster_servers:
            return ",".join(s.url for s in self.cluster_servers)
        peers = [u for u in self.machine.get("servers", []) if self.nats is None or u != self.nats.url]
        if self.nats is None:
            return ",".join(peers)
        return ",".join([self.nats.url, *peers])

    @property
    def replicas(self) -> int:
        if self.machine:  # one replica until there are servers on other machines (`zattera cluster replicas`)
            return 1
        return len(self.cluster_servers) or 1

    def _launch(self, child: Supervised) -> None:
        child.start(die_with_parent=self.die_with_parent)

    def start_nats(self) -> None:
        if self.machine:
            if "seats" in self.machine:  # the first server machine: three seats of the JetStream cluster
                self.cluster_servers = start_cluster(
                    self.layout.control / "nats-cluster",
                    die_with_parent=self.die_with_parent,
                    extra_config=self.nats_extra_config,
                    routes=RouteSecurity(**self.nats_routes),
                    **self.machine["seats"],
                )
                self.nats = self.cluster_servers[0]
            elif "nats" in self.machine:
                self.nats = EmbeddedNats(
                    data_dir=self.layout.control / "nats",
                    extra_config=self.nats_extra_config,
                    die_with_parent=self.die_with_parent,
                    **self.machine["nats"],
                ).start(wait=60.0)
            return
        if self.nats_cluster > 1:
            self.cluster_servers = start_cluster(
                self.layout.control / "nats-cluster",
                self.nats_cluster,
                die_with_parent=self.die_with_parent,
                extra_config=self.nats_extra_config,
                routes=RouteSecurity(**self.nats_routes) if self.nats_routes else None,
            )
            self.nats = self.cluster_servers[0]
            return
        port = self.port
        if port and not _port_free(port):
            self.console.print(f"[yellow]port {port} is busy; using a free port instead[/]")
            port = free_port()
        self.nats = EmbeddedNats(
            data_dir=self.layout.control / "nats",
            port=port,
            extra_config=self.nats_extra_config,
            die_with_parent=self.die_with_parent,
        ).start()

    def child_env(self) -> dict[str, str]:
        """The control plane's environment (the local node's: :meth:`_node_env`)."""
        env = dict(os.environ)
        env["ZATTERA_NATS_URL"] = self.url
        env["ZATTERA_DATA_DIR"] = str(self.layout.control)
        if self.cluster_servers:
            env["ZATTERA_REPLICAS"] = str(self.replicas)
        env.setdefault("ZATTERA_DOMAIN", "localhost")
        if self.creds:
            env["ZATTERA_NATS_CREDS"] = self.creds
        if self.tls_ca:
            env["ZATTERA_NATS_TLS_CA"] = self.tls_ca
        env.setdefault("PYTHONUNBUFFERED", "1")
        return {**env, **self.machine.get("env", {})}

    def control_plane(self) -> list[tuple[str, str]]:
        """(process name, module) of each control-plane process."""
        if self.all_in_one and self.services:
            return [(ALL_IN_ONE, "cli.control_plane")]
        return [(name, f"services.{name}") for name in self.services]

    def console_env(self) -> dict[str, str]:
        """The console's port: ``ZATTERA_CONSOLE_PORT`` when set, else :attr:`console_port` or a free one."""
        if "ZATTERA_CONSOLE_PORT" in os.environ:
            self.console_port = int(os.environ["ZATTERA_CONSOLE_PORT"])
        elif not _port_free(self.console_port):
            self.console_port = free_port()
        return {"ZATTERA_CONSOLE_PORT": str(self.console_port)}

    def start_services(self) -> None:
        env = self.child_env()
        for name, module in self.control_plane():
            child = Supervised(
                name,
                [sys.executable, "-m", module, "--nats", self.url, *self.metrics_args(name)],
                self.layout.logs / f"{name}.log",
                {**env, **self.console_env()} if name in ("console", ALL_IN_ONE) else env,
            )
            self._launch(child)
            self.children.append(child)
        if self.with_node:
            self.children.extend(self._node_processes(env))
        for child in self.extra:
            if self.all_in_one and self.services and child.name in ALL_IN_ONE_SERVICES:
                continue  # the all-in-one process runs it already
            child.env = {**env, **child.env}
            self._launch(child)
            self.children.append(child)

    @property
    def agent_data_dir(self) -> Path:
        return self.layout.agent

    def report_runtime(self) -> None:
        """Say on the terminal which runtime the local agent chose and why, and how it isolates apps, once it has
        (and again when a restarted agent chose otherwise): a fallback to bare processes, or to apps without
        a sandbox, must not hide in the agent's log."""
        note = read_runtime_note(self.agent_data_dir) if self.with_node else None
        if note is None or note == self.runtime_note:
            return
        self.runtime_note = note
        colour = "green" if note.runtime == "docker" else "yellow"
        self.console.print(f"  [{colour}]agent runtime: {note.runtime}[/] — {escape(note.reason)}")
        if note.isolation:  # how its apps and builds are kept from the node and each other (SECURITY.md "Apps")
            colour = "red" if note.isolation.startswith("NOT") else "green"
            self.console.print(f"  [{colour}]apps: {escape(note.isolation)}[/]")

    def _node_processes(self, env: dict[str, str]) -> list[Supervised]:
        """The local node: an agent (docker runtime when a Docker daemon answers, else processes; the builder)
        and the ingress proxy."""
        found = []
        root = PROJECT_ROOT / "services"
        if (root / "agent" / "__main__.py").exists():
            (self.agent_data_dir / RUNTIME_NOTE).unlink(missing_ok=True)  # the one this start writes, not a stale one
            agent = Supervised(
                "agent",
                [
                    sys.executable,
                    "-m",
                    "services.agent",
                    "--nats",
                    self.url,
                    "--node-id",
                    self.node_id,
                    "--data-dir",
                    str(self.agent_data_dir),
                    "--builder",
                    "--roles",
                    "worker,control",
                    # Ctrl-C leaves no process behind: the app instances stop with the agent, and the next
                    # `zattera up` starts them again from the same desired state.
                    "--stop-on-exit",
                    *self.machine.get("agent_args", []),
                    *self.metrics_args("agent"),
                ],
                self.layout.logs / "agent.log",
                {
                    **self._node_env(env, "agent", self.agent_data_dir),
                    # Should an app's directory contain the data dir: every sandbox shows it empty.
                    "ZATTERA_AGENT_SANDBOX_HIDDEN": str(self.data_dir),
                },
            )
            self._launch(agent)
            found.append(agent)
        if (root / "proxy" / "__main__.py").exists():
            port = self.proxy_port if _port_free(self.proxy_port) else free_port()
            self.proxy_port = port
            if self.proxy_tls_listen:
                tls_host, tls_port = split_listen(self.proxy_tls_listen)
                tls_port = tls_port if tls_port and _port_free(tls_port) else free_port()
                self.proxy_tls_listen = f"[{tls_host}]:{tls_port}" if ":" in tls_host else f"{tls_host}:{tls_port}"
            proxy = Supervised(
                "proxy",
                [
                    sys.executable,
                    "-m",
                    "services.proxy",
                    "--nats",
                    self.url,
                    "--host",
                    self.proxy_host,
                    "--port",
                    str(port),
                    "--node-id",
                    self.node_id,
                    "--proxy-id",
                    self.node_id,
                    "--cache-dir",
                    str(self.layout.proxy),
                    *(["--tls-listen", self.proxy_tls_listen] if self.proxy_tls_listen else []),
                    *self.metrics_args("proxy"),
                ],
                self.layout.logs / "proxy.log",
                self._node_env(env, "proxy", self.layout.proxy),
            )
            self._launch(proxy)
            found.append(proxy)
        return found

    def _node_env(self, env: dict[str, str], name: str, directory: Path) -> dict[str, str]:
        """The local agent's or proxy's environment: its own directory, credential and CA copy, nothing that
        points into the control plane's directory."""
        own = {
            k: v
            for k, v in env.items()
            if k not in ("ZATTERA_NATS_CREDS", "ZATTERA_NATS_TLS_CA") and not k.startswith(CONTROL_ONLY_SETTINGS)
        }
        own["ZATTERA_DATA_DIR"] = str(directory)
        if self.node_creds.get(name):
            own["ZATTERA_NATS_CREDS"] = self.node_creds[name]
        if self.tls_ca:
            copy = directory / NATS_CA
            directory.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(Path(self.tls_ca).read_bytes())  # a certificate: public, but the node's own copy
            own["ZATTERA_NATS_TLS_CA"] = str(copy)
        return own

    def supervise_nats(self) -> None:
        """Restart a NATS server that died (same ports, same store: it rejoins the cluster and catches up),
        with the services' backoff."""
        now = time.monotonic()
        for server in self.cluster_servers or ([self.nats] if self.nats is not None else []):
            code = server.exited()
            if code is None or now < self.nats_next_start.get(server.name, 0.0):
                continue
            attempts = self.nats_restarts.get(server.name, 0)
            self.console.print(f"[red]NATS server {server.name} exited ({code}); restarting[/]")
            try:
                server.start(wait=15.0)
                self.nats_restarts[server.name] = 0
            except EmbeddedNatsError as exc:
                backoff = exponential(RESTART_FIRST, attempts + 1, RESTART_MOST)
                self.nats_restarts[server.name] = attempts + 1
                self.nats_next_start[server.name] = now + backoff
                self.console.print(
                    f"[red]NATS server {server.name} did not restart ({exc}); again in {backoff:.1f}s[/]"
                )

    def supervise_once(self) -> None:
        self.supervise_nats()
        now = time.monotonic()
        for child in self.children:
            if child.alive():
                continue
            if child.next_start == 0.0:
                backoff = exponential(RESTART_FIRST, child.restarts + 1, RESTART_MOST)
                if now - child.started_at > 60:
                    child.restarts = 0
                    backoff = RESTART_FIRST
                child.next_start = now + backoff
                code = child.proc.returncode if child.proc else None
                self.console.print(f"[red]{child.name} exited ({code}); restarting in {backoff:.1f}s[/]")
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                self._launch(child)

    def roll(self, say: Callable[[str], None], *, wait: float = 120.0) -> bool:
        """Roll every process onto the code installed now, one at a time (control plane, then the rest, the
        agent and the proxy last): the cluster's migrations first (a refusal leaves everything as it runs),
        then each stopped with :data:`RESTART_SIGNAL` (an agent keeps its instances) and started again, the
        next only once it runs. Nothing restarts when the code has not changed; NATS is not restarted."""
        code = code_identity()
        if code == self.code:
            say(f"{ROLL_DONE} already running the code installed now: nothing restarted")
            return True
        say("upgrading the cluster with the code installed now")
        try:
            provision_in_child(self, echo=say)
        except SystemExit as exc:
            why = exc.code if isinstance(exc.code, str) else "the cluster's upgrade was refused (above)"
            say(f"{ROLL_REFUSED} {why}; every process keeps running the code it started with")
            return False
        order = sorted(self.children, key=lambda c: {"agent": 1, "proxy": 2}.get(c.name, 0))
        for child in order:
            offset = child.log_size()
            say(f"restarting {child.name}")
            if child.alive():
                assert child.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.proc.pid, RESTART_SIGNAL)
                child.wait_or_kill(time.monotonic() + 30.0)
            self._launch(child)
            child.next_start = 0.0
            deadline = time.monotonic() + wait
            while not child.started_since(offset):
                if time.monotonic() > deadline or not child.alive():
                    say(f"{ROLL_REFUSED} {child.name} did not start (log {child.log_path}); the supervisor restarts it")
                    return False
                time.sleep(0.2)
            say(f"{child.name} runs the new code (pid {child.proc.pid if child.proc else '-'})")
        self.code = code
        say(f"{ROLL_DONE} every process runs the code installed now; apps kept running")
        return True

    def stop(self, grace: float = 10.0) -> None:
        for child in self.children:
            child.terminate()
        deadline = time.monotonic() + grace
        for child in self.children:
            child.wait_or_kill(deadline)
        for server in self.cluster_servers:
            server.stop()
        if self.nats is not None:
            self.nats.stop()


CONFIG_FIELDS = (
    "port",
    "proxy_port",
    "proxy_host",
    "proxy_tls_listen",
    "with_node",
    "services",
    "all_in_one",
    "nats_cluster",
    "nats_extra_config",
    "nats_routes",
    "creds",
    "tls_ca",
    "node_creds",
    "metrics_port",
    "node_id",
    "machine",
)
"""The :class:`Cluster` fields besides ``data_dir`` and ``extra`` that say what to run (the others are
what runs)."""

NEXT_STEPS = """
Next, in another terminal (ZATTERA_NATS_URL={nats}):
  .venv/bin/zattera nodes list
  .venv/bin/zattera apps apply examples/hello/zattera.toml
  .venv/bin/zattera deploy examples/hello --env demo/hello/production
  curl -H 'Host: hello.localhost' http://127.0.0.1:{port}/
"""


def data_plane_text() -> str:
    """Which data plane the proxy runs (the choice ``python -m services.proxy`` makes without ``--engine``)."""
    if choose_engine(os.environ.get("ZATTERA_PROXY_ENGINE", "")) == "haproxy":
        return "haproxy (cold and basic-auth requests through the Python handler; docs/ingress.md)"
    return "python (haproxy not installed: make system-packages installs it; docs/ingress.md)"


def https_text(tls_listen: str, local_ca: Path) -> str:
    """Where the proxy serves HTTPS (the haproxy engine only), and how to trust its local certificates."""
    if not tls_listen:
        return "off (--proxy-tls-listen HOST:PORT turns it on)"
    if choose_engine(os.environ.get("ZATTERA_PROXY_ENGINE", "")) != "haproxy":
        return "off: TLS needs the haproxy engine (make system-packages installs it; docs/certificates.md)"
    port = split_listen(tls_listen)[1]
    return f"https://<app>-<env>.localhost:{port}  (curl --cacert {local_ca} …)"


def proxy_listen_text(host: str, port: int) -> str:
    """Where the proxy listens, and what that means for who can reach it."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host in ("0.0.0.0", "::"):
        return f"{address} (every interface; --proxy-listen 127.0.0.1:{port} keeps it on this machine)"
    return address


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


REFUSED_EXIT = 2
"""The provisioning child's status when this version may not run on the cluster (it said why on stderr)."""


async def _provision(url: str, creds: str = "", tls_ca: str = "", replicas: int = 1) -> int:
    """Create what is missing, then bring the cluster to this code's schema, saying on stderr which
    migrations ran (docs/upgrades.md); :data:`REFUSED_EXIT` when this version may not run on it."""
    import asyncio

    from shared.connection import connect
    from shared.events import EventPublisher
    from shared.lease import default_holder
    from shared.migrations.runner import MigrationFailed, upgrade
    from shared.provisioning import provision
    from shared.skew import SkewRefused

    conn = await connect(url, name="zattera-up", creds=creds or None, tls_ca=tls_ca or None)
    try:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                await asyncio.wait_for(provision(conn.js, replicas=replicas), 5.0)
                break
            except Exception:
                # a fresh cluster elects its JetStream meta leader first; a single server answers at once
                if replicas == 1 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        try:
            await upgrade(
                conn,
                holder=default_holder("zattera-up"),
                progress=lambda line: print(line, file=sys.stderr, flush=True),
                events=EventPublisher(conn),
            )
        except (SkewRefused, MigrationFailed) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return REFUSED_EXIT
        return 0
    finally:
        await conn.close()


PROVISION_ENV = "ZATTERA_UP_PROVISION"
"""How :func:`provision_in_child` hands what to provision (URL, credentials file, CA file, replicas) to it."""


def provision_in_child(cluster: Cluster, echo: Callable[[str], None] | None = None) -> None:
    """Provision ``cluster`` from a short-lived interpreter (``python -m cli.up`` with :data:`PROVISION_ENV`):
    nats-py and asyncio, loaded here once, would stay resident in the supervisor for as long as the cluster
    runs (~15 MB of a single machine's control plane, PERFORMANCE.md "footprint"). Its error, if any, is on
    stderr (given to ``echo`` line by line, when given); SystemExit here then stops the cluster."""
    given = {"url": cluster.url, "creds": cluster.creds, "tls_ca": cluster.tls_ca, "replicas": cluster.replicas}
    env = {**os.environ, PROVISION_ENV: json.dumps(given)}
    done = subprocess.run(
        [sys.executable, "-m", "cli.up"],
        env=env,
        cwd=PROJECT_ROOT,
        check=False,
        stderr=subprocess.PIPE if echo else None,
        text=True,
    )
    if echo is not None:
        for line in (done.stderr or "").splitlines():
            echo(line)
    if done.returncode == REFUSED_EXIT:
        raise SystemExit(REFUSED_EXIT)  # the child said why, in one line
    if done.returncode != 0:
        raise SystemExit(f"provisioning the streams and buckets at {cluster.url} failed (exit {done.returncode})")


CLUSTER_ENV = "ZATTERA_UP_CLUSTER"
"""How :func:`run_up` hands the cluster to the supervisor it execs (the environment: never on a command
line, where other users could read the NATS server configuration)."""


def run_up(cluster: Cluster, *, hint: str = "") -> NoReturn:
    """Supervise ``cluster`` until Ctrl-C, in a fresh interpreter that imports only what supervising needs.

    This process replaces itself (``exec``: same pid, terminal and signals, so Ctrl-C and the exit status
    are the caller's) with ``python -m cli.up``: the CLI's command modules, loaded to parse the options,
    would otherwise stay resident for as long as the cluster runs (~20 MB of a single machine's control
    plane, PERFORMANCE.md "footprint").
    """
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, CLUSTER_ENV: json.dumps({"cluster": cluster.config(), "hint": hint})}
    os.execve(sys.executable, [sys.executable, "-m", "cli.up"], env)


def code_identity(root: Path = PROJECT_ROOT) -> str:
    """What the installed code is, cheaply: every source file's path, size and modification time (a pull
    or a checkout changes them)."""
    digest = hashlib.sha256()
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path.relative_to(root)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def hold_supervisor_lock(data_dir: Path) -> IO[str] | None:
    """Lock ``<data_dir>/up.pid`` for this process's life and write its pid there; None when another
    supervisor holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = (data_dir / PID_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def running_supervisor(data_dir: Path) -> int | None:
    """The pid of the supervisor running from ``data_dir``, or None."""
    path = data_dir / PID_FILE
    if not path.exists():
        return None
    with path.open("r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = handle.read().strip()
            return int(text) if text.isdigit() else None
    return None


def request_roll(data_dir: Path, pid: int, *, timeout: float = 900.0, out: Callable[[str], None] = print) -> int:
    """Ask the supervisor ``pid`` to roll its processes onto the code installed now and print its progress
    until it is done: 0 when done, 1 when refused or cut short."""
    log = data_dir / ROLL_LOG
    log.write_text("")
    os.kill(pid, ROLL_SIGNAL)
    out(f"zattera up is running from {data_dir} (pid {pid}): rolling its processes onto the code installed now")
    seen = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines()
        for line in lines[seen:]:
            out(f"  {line}")
            if line.startswith(ROLL_DONE):
                return 0
            if line.startswith(ROLL_REFUSED):
                return 1
        seen = len(lines)
        if running_supervisor(data_dir) != pid:
            out(f"the supervisor (pid {pid}) stopped before it was done")
            return 1
        time.sleep(0.2)
    out(f"no end of the roll within {timeout:.0f}s: see {log}")
    return 1


def supervise(cluster: Cluster, *, hint: str = "") -> int:
    stop = False
    roll = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    def on_roll(_sig: int, _frame: object) -> None:
        nonlocal roll
        roll = True

    lock = hold_supervisor_lock(cluster.data_dir)
    if lock is None:
        cluster.console.print(f"[red]another zattera up runs from {cluster.data_dir}[/] (pid {PID_FILE})")
        return 1
    # SIGHUP: the terminal went away (a closed window, a dropped SSH session) — stop as for Ctrl-C.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    previous[ROLL_SIGNAL] = signal.signal(ROLL_SIGNAL, on_roll)
    cluster.die_with_parent = True
    console = cluster.console
    try:
        cluster.layout.make()
        cluster.start_nats()
        cluster.code = code_identity()
        provision_in_child(cluster)
        cluster.start_services()
        console.print(f"[bold green]Zattera is up[/] — data in {cluster.data_dir}")
        console.print(
            f"  NATS:      {cluster.url}"
            + (f"  (cluster, replicas={cluster.replicas})" if cluster.cluster_servers else "")
            + ("" if cluster.creds else "  (no authentication: every local process can use it, apps included;"
               " --secure before running untrusted apps)")
        )
        for child in cluster.children:
            metrics = cluster.metrics_ports.get(child.name)
            where = f"  metrics http://127.0.0.1:{metrics}/metrics" if metrics else ""
            pid = child.proc.pid if child.proc else "-"
            console.print(f"  {child.name:<13} pid {pid}  log {child.log_path}{where}")
        if any(c.name in ("certs", ALL_IN_ONE) for c in cluster.children):
            local_ca = cluster.layout.local_ca
            console.print(f"  HTTPS:     *.localhost certificates from a local CA: trust {local_ca}")
        if any(c.name == "proxy" for c in cluster.children):
            console.print(f"  proxy:     listening on {proxy_listen_text(cluster.proxy_host, cluster.proxy_port)}")
            console.print(f"             data plane: {data_plane_text()}")
            console.print(f"             http://127.0.0.1:{cluster.proxy_port}  (apps at <app>-<env>.localhost)")
            console.print(f"             HTTPS: {https_text(cluster.proxy_tls_listen, cluster.layout.local_ca)}")
        if any(c.name in ("console", ALL_IN_ONE) for c in cluster.children):
            console.print(
                f"  console:   http://127.0.0.1:{cluster.console_port}  (users: `zattera console add-user NAME`)"
            )
        console.print(hint or NEXT_STEPS.format(nats=cluster.url, port=cluster.proxy_port))
        console.print("Press Ctrl-C to stop.")
        while not stop:
            if roll:
                roll = False
                cluster.roll(lambda line: _roll_progress(cluster, line))
            cluster.supervise_once()
            cluster.report_runtime()
            time.sleep(0.2)
    finally:
        # The terminal or the pipe it printed to may be gone (`zattera up | tee log` and Ctrl-C ends tee
        # too): saying so must not keep the cluster from stopping.
        with contextlib.suppress(OSError):
            console.print("stopping…")
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            console.print("stopped.")
        lock.close()
    return 0


def _roll_progress(cluster: Cluster, line: str) -> None:
    """A roll's progress: on the supervisor's terminal, and in ``<data_dir>/up-roll.log`` for the requester."""
    with contextlib.suppress(OSError):
        cluster.console.print(f"upgrade: {line}", markup=False, highlight=False)
    with (cluster.data_dir / ROLL_LOG).open("a") as log:
        log.write(line + "\n")


def main() -> None:
    """``python -m cli.up``, as :func:`run_up` execs it (and :func:`provision_in_child` runs it)."""
    if PROVISION_ENV in os.environ:
        import asyncio

        sys.exit(asyncio.run(_provision(**json.loads(os.environ.pop(PROVISION_ENV)))))
    given = json.loads(os.environ.pop(CLUSTER_ENV))
    sys.exit(supervise(Cluster.from_config(given["cluster"]), hint=given["hint"]))


if __name__ == "__main__":
    main()
