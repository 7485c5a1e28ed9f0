"""The processes of ``zattera up``'s single-machine cluster: :class:`Cluster` (what runs, with which options,
started, watched, restarted with backoff and stopped in order) and :class:`Supervised` (one process of it).
The supervisor that drives them is :mod:`cli.up`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from cli.layout import DataLayout
from cli.supervised import PROJECT_ROOT, RESTART_FIRST, RESTART_MOST, Supervised, port_free
from cli.up_provision import provision_in_child
from cli.up_roll import RESTART_SIGNAL, ROLL_DONE, ROLL_REFUSED, code_identity
from services.proxy.launch import DEFAULT_HOST as DEFAULT_PROXY_HOST
from shared.backoff import exponential
from shared.embedded import (
    RETIRED_SEATS_FILE,
    EmbeddedNats,
    EmbeddedNatsError,
    RouteSecurity,
    free_port,
    start_cluster,
)
from shared.runtime_note import RuntimeNote, read_runtime_note

SERVICES = ("scheduler", "orchestrator", "autoscale", "builds", "routes", "secrets", "certs", "console")


ALL_IN_ONE = "control-plane"
"""The process that runs every service of ``cli.control_plane`` (``join`` included: idle unless secured)."""


ALL_IN_ONE_SERVICES = frozenset((*SERVICES, "join"))


LOCAL_NODE = "local"


CONTROL_ONLY_SETTINGS = tuple(sorted(f"ZATTERA_{name.upper()}_" for name in ALL_IN_ONE_SERVICES))
"""The control-plane services' own variables (``ZATTERA_SECRETS_KEY``: the cluster key): never given to the
local agent or proxy."""


DEFAULT_METRICS_PORT = 9400


def available_services() -> list[str]:
    return [s for s in SERVICES if (PROJECT_ROOT / "services" / s / "__main__.py").exists()]


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

    def known_control_ports(self) -> list[int]:
        """The control plane's ports known before they listen: the console's and the metrics ports given."""
        self.console_env()  # settles the console's port (ZATTERA_CONSOLE_PORT, or a free one when busy)
        return sorted({self.console_port, *self.metrics_ports.values()} - {0})

    def metrics_args(self, name: str) -> list[str]:
        """``--metrics-port N`` for process ``name`` (nothing when metrics are off)."""
        if not self.metrics_port:
            return []
        if name not in self.metrics_ports:
            wanted = self.metrics_port + len(self.metrics_ports)
            taken = set(self.metrics_ports.values())
            self.metrics_ports[name] = wanted if wanted not in taken and port_free(wanted) else free_port()
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

    def launch(self, child: Supervised) -> None:
        """Start ``child`` (dying with this process when :attr:`die_with_parent`)."""
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
        if port and not port_free(port):
            self.console.print(f"[yellow]port {port} is busy; using a free port instead[/]")
            port = free_port()
        self.nats = EmbeddedNats(
            data_dir=self.layout.control / "nats",
            port=port,
            extra_config=self.nats_extra_config,
            die_with_parent=self.die_with_parent,
        ).start()

    def child_env(self) -> dict[str, str]:
        """The control plane's environment (the local node's: :func:`cli.up_node.node_env`)."""
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
        """The console's port: ``ZATTERA_CONSOLE_PORT`` when set, else :attr:`console_port` or a free one. Read
        from the environment itself: the resident supervisor loads no settings (pydantic-settings, ~20 MB)."""
        if "ZATTERA_CONSOLE_PORT" in os.environ:
            self.console_port = int(os.environ["ZATTERA_CONSOLE_PORT"])
        elif not port_free(self.console_port):
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
            self.launch(child)
            self.children.append(child)
        if self.with_node:
            from cli.up_node import node_processes  # the node's module reads this one's settings

            self.children.extend(node_processes(self, env))
        for child in self.extra:
            if self.all_in_one and self.services and child.name in ALL_IN_ONE_SERVICES:
                continue  # the all-in-one process runs it already
            child.env = {**env, **child.env}
            self.launch(child)
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

    def stop_retired_seats(self) -> None:
        """Stop the first machine's extra seats once retired (peer-removed by its join service, which records
        them): never restarted, since a removed server started again would rejoin JetStream."""
        if len(self.cluster_servers) < 2 or "seats" not in self.machine:
            return
        marker = self.layout.control / RETIRED_SEATS_FILE
        if not marker.exists():
            return
        retired = set(json.loads(marker.read_text()))
        for server in [s for s in self.cluster_servers[1:] if s.name in retired]:
            self.console.print(f"NATS server {server.name}: seat retired, stopped")
            server.stop()
            self.cluster_servers.remove(server)

    def supervise_nats(self) -> None:
        """Restart a NATS server that died (same ports, same store: it rejoins the cluster and catches up),
        with the services' backoff."""
        self.stop_retired_seats()
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
                self.launch(child)

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
            self.launch(child)
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
