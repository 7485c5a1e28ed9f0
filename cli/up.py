"""``zattera up``: the whole single-machine cluster on the embedded NATS server.

Starts nats-server (JetStream, data under ``<data_dir>/nats``), provisions the buckets and streams,
then the control plane — every service in one process (``cli.control_plane``, the default), or each service
as its own process (``--separate``) — and the local node (logs under ``<data_dir>/logs``), restarts a service or a NATS
server that dies (with backoff), and on Ctrl-C / SIGTERM stops the services (SIGTERM, then SIGKILL after a grace) and
then NATS, leaving no process behind. Running it again resumes the same cluster from its data dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from services.proxy.launch import DEFAULT_HOST as DEFAULT_PROXY_HOST
from services.proxy.launch import choose_engine, split_listen
from shared.backoff import exponential
from shared.embedded import EmbeddedNats, EmbeddedNatsError, RouteSecurity, free_port, start_cluster
from shared.subprocesses import spawn_logged

SERVICES = ("scheduler", "orchestrator", "autoscale", "builds", "routes", "secrets", "certs", "console")
ALL_IN_ONE = "control-plane"
"""The process that runs every service of ``cli.control_plane`` (``join`` included: idle unless secured)."""
ALL_IN_ONE_SERVICES = frozenset((*SERVICES, "join"))
LOCAL_NODE = "local"
DEFAULT_METRICS_PORT = 9400
RESTART_FIRST = 0.5
"""Seconds before a process that died is started again; doubling per restart within a minute of its start."""
RESTART_MOST = 30.0
"""``zattera up``'s first metrics port: scheduler 9400, orchestrator 9401, … in start order."""
PROJECT_ROOT = Path(__file__).resolve().parents[1]


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
    console: Console = field(default_factory=lambda: Console(stderr=True))
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
    # One machine of a cluster of machines (cli/machine.py): its node id, its NATS server (a route member,
    # or none on a worker, which uses ``machine["servers"]``), the agent's flags and the services' settings.
    node_id: str = LOCAL_NODE
    machine: dict[str, Any] = field(default_factory=dict)

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
                    self.data_dir / "nats-cluster",
                    die_with_parent=self.die_with_parent,
                    extra_config=self.nats_extra_config,
                    routes=RouteSecurity(**self.nats_routes),
                    **self.machine["seats"],
                )
                self.nats = self.cluster_servers[0]
            elif "nats" in self.machine:
                self.nats = EmbeddedNats(
                    data_dir=self.data_dir / "nats",
                    extra_config=self.nats_extra_config,
                    die_with_parent=self.die_with_parent,
                    **self.machine["nats"],
                ).start(wait=60.0)
            return
        if self.nats_cluster > 1:
            self.cluster_servers = start_cluster(
                self.data_dir / "nats-cluster",
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
            data_dir=self.data_dir / "nats",
            port=port,
            extra_config=self.nats_extra_config,
            die_with_parent=self.die_with_parent,
        ).start()

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["ZATTERA_NATS_URL"] = self.url
        env["ZATTERA_DATA_DIR"] = str(self.data_dir)
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
        from services.console.settings import ConsoleSettings

        console = ConsoleSettings()
        if "port" in console.model_fields_set:
            self.console_port = console.port
        elif not _port_free(self.console_port):
            self.console_port = free_port()
        return {"ZATTERA_CONSOLE_PORT": str(self.console_port)}

    def start_services(self) -> None:
        env = self.child_env()
        for name, module in self.control_plane():
            child = Supervised(
                name,
                [sys.executable, "-m", module, "--nats", self.url, *self.metrics_args(name)],
                self.data_dir / "logs" / f"{name}.log",
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

    def _node_processes(self, env: dict[str, str]) -> list[Supervised]:
        """The local node: an agent (process runtime + builder) and the ingress proxy."""
        found = []
        root = PROJECT_ROOT / "services"
        if (root / "agent" / "__main__.py").exists():
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
                    str(self.data_dir / "agent"),
                    "--builder",
                    "--roles",
                    "worker,control",
                    # Ctrl-C leaves no process behind: the app instances stop with the agent, and the next
                    # `zattera up` starts them again from the same desired state.
                    "--stop-on-exit",
                    *self.machine.get("agent_args", []),
                    *self.metrics_args("agent"),
                ],
                self.data_dir / "logs" / "agent.log",
                self._node_env(env, "agent"),
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
                    str(self.data_dir / "proxy"),
                    *(["--tls-listen", self.proxy_tls_listen] if self.proxy_tls_listen else []),
                    *self.metrics_args("proxy"),
                ],
                self.data_dir / "logs" / "proxy.log",
                self._node_env(env, "proxy"),
            )
            self._launch(proxy)
            found.append(proxy)
        return found

    def _node_env(self, env: dict[str, str], name: str) -> dict[str, str]:
        creds = self.node_creds.get(name)
        return {**env, "ZATTERA_NATS_CREDS": creds} if creds else env

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


def _proxy_engine() -> str:
    """``ZATTERA_PROXY_ENGINE`` ('' = the proxy picks)."""
    from services.proxy.settings import ProxySettings  # the proxy's modules, only for this line of output

    return ProxySettings().engine


def data_plane_text() -> str:
    """Which data plane the proxy runs (the choice ``python -m services.proxy`` makes without ``--engine``)."""
    if choose_engine(_proxy_engine()) == "haproxy":
        return "haproxy (cold and basic-auth requests through the Python handler; docs/ingress.md)"
    return "python (haproxy not installed: make system-packages installs it; docs/ingress.md)"


def https_text(tls_listen: str, local_ca: Path) -> str:
    """Where the proxy serves HTTPS (the haproxy engine only), and how to trust its local certificates."""
    if not tls_listen:
        return "off (--proxy-tls-listen HOST:PORT turns it on)"
    if choose_engine(_proxy_engine()) != "haproxy":
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


async def _provision(url: str, creds: str = "", tls_ca: str = "", replicas: int = 1) -> None:
    import asyncio

    from shared.natsio import connect, provision

    conn = await connect(url, name="zattera-up", creds=creds or None, tls_ca=tls_ca or None)
    try:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                await asyncio.wait_for(provision(conn.js, replicas=replicas), 5.0)
                return
            except Exception:
                # a fresh cluster elects its JetStream meta leader first; a single server answers at once
                if replicas == 1 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await conn.close()


PROVISION_ENV = "ZATTERA_UP_PROVISION"
"""How :func:`provision_in_child` hands what to provision (URL, credentials file, CA file, replicas) to it."""


def provision_in_child(cluster: Cluster) -> None:
    """Provision ``cluster`` from a short-lived interpreter (``python -m cli.up`` with :data:`PROVISION_ENV`):
    nats-py and asyncio, loaded here once, would stay resident in the supervisor for as long as the cluster
    runs (~15 MB of a single machine's control plane, PERFORMANCE.md "footprint"). Its error, if any, is on
    stderr; SystemExit here then stops the cluster."""
    given = {"url": cluster.url, "creds": cluster.creds, "tls_ca": cluster.tls_ca, "replicas": cluster.replicas}
    env = {**os.environ, PROVISION_ENV: json.dumps(given)}
    done = subprocess.run([sys.executable, "-m", "cli.up"], env=env, cwd=PROJECT_ROOT, check=False)
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


def supervise(cluster: Cluster, *, hint: str = "") -> int:
    stop = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    # SIGHUP: the terminal went away (a closed window, a dropped SSH session) — stop as for Ctrl-C.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    cluster.die_with_parent = True
    console = cluster.console
    try:
        cluster.start_nats()
        provision_in_child(cluster)
        cluster.start_services()
        console.print(f"[bold green]Zattera is up[/] — data in {cluster.data_dir}")
        console.print(
            f"  NATS:      {cluster.url}"
            + (f"  (cluster, replicas={cluster.replicas})" if cluster.cluster_servers else "")
        )
        for child in cluster.children:
            metrics = cluster.metrics_ports.get(child.name)
            where = f"  metrics http://127.0.0.1:{metrics}/metrics" if metrics else ""
            pid = child.proc.pid if child.proc else "-"
            console.print(f"  {child.name:<13} pid {pid}  log {child.log_path}{where}")
        if any(c.name in ("certs", ALL_IN_ONE) for c in cluster.children):
            local_ca = cluster.data_dir / "certs" / "local-ca.pem"
            console.print(f"  HTTPS:     *.localhost certificates from a local CA: trust {local_ca}")
        if any(c.name == "proxy" for c in cluster.children):
            console.print(f"  proxy:     listening on {proxy_listen_text(cluster.proxy_host, cluster.proxy_port)}")
            console.print(f"             data plane: {data_plane_text()}")
            console.print(f"             http://127.0.0.1:{cluster.proxy_port}  (apps at <app>-<env>.localhost)")
            local_ca = cluster.data_dir / "certs" / "local-ca.pem"
            console.print(f"             HTTPS: {https_text(cluster.proxy_tls_listen, local_ca)}")
        if any(c.name in ("console", ALL_IN_ONE) for c in cluster.children):
            console.print(
                f"  console:   http://127.0.0.1:{cluster.console_port}  (users: `zattera console add-user NAME`)"
            )
        console.print(hint or NEXT_STEPS.format(nats=cluster.url, port=cluster.proxy_port))
        console.print("Press Ctrl-C to stop.")
        while not stop:
            cluster.supervise_once()
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
    return 0


def main() -> None:
    """``python -m cli.up``, as :func:`run_up` execs it (and :func:`provision_in_child` runs it)."""
    if PROVISION_ENV in os.environ:
        import asyncio

        asyncio.run(_provision(**json.loads(os.environ.pop(PROVISION_ENV))))
        return
    given = json.loads(os.environ.pop(CLUSTER_ENV))
    sys.exit(supervise(Cluster.from_config(given["cluster"]), hint=given["hint"]))


if __name__ == "__main__":
    main()
