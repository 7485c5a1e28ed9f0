"""What HAProxy runs for one route table (pure): the :class:`Plan` (hosts, paths, backends and their servers;
made from a route snapshot by :mod:`services.proxy.haproxy_plan`), the :class:`Layout` (where HAProxy listens
and keeps its files, its timers) and the configuration text of both.

The frontend does per request only what some route needs, each step a rule HAProxy runs on every request
(valgrind, a keep-alive request: ~38,400 user-space instructions, against ~30,400 for a hand-written host map
to one backend and ~36,600 for one that also sets the same forwarded headers; PERFORMANCE.md has each rule's
share): the forwarded headers, ACME challenges to ``hold``, the path map (only with path-prefixed routes), the
host map in ``use_backend`` itself, ``no_route`` (the JSON 404) by default; ``txn.https`` is computed only
when a backend redirects to HTTPS.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.proxy.haproxy_rules import HTTPS_VAR, json_return, ms
from services.proxy.pipeline import ORDER
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH

HOLD_BACKEND = "hold"
HOLD_BACKUP_SERVER = "zattera_hold"
HELD_CHECK_INTER = "2s"
HOLD_RETRIES = 10
"""A request for the Python handler waits this many seconds at most for a proxy process that is restarting."""
HOLD_PORT_FILE = "hold.port"
"""In the HAProxy directory: the Python handler's loopback port, taken again by the next proxy process while it
is free, so an HAProxy that outlived a proxy process reaches the next one."""
NO_ROUTE_BACKEND = "no_route"
"""Where a request whose host and path match no route goes: the JSON 404, answered by HAProxy."""
SOCKET_DIR_MAX = 70
IDLE_POOL = "pool-max-conn -1 pool-purge-delay 5s"
"""Every server keeps its idle backend connections for reuse (no limit; half of the unused ones closed every
5 s). Configured servers get these values by default, but a server added at run time (``add server``, how
endpoints arrive) gets none in HAProxy 2.6 (``show servers conn``: ``idle_lim 0``): each request would open a
new backend connection, at three times the CPU per request. Spelled out on every line for both paths."""


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    addr: str
    weight: int
    maxconn: int
    cookie: str
    release_id: str = ""
    """A weighted (canary) route's server: its release and step tag, what its counters are reported by."""
    step_tag: str = ""


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    env_id: str
    rules: tuple[str, ...]
    """Configuration lines of the backend besides its servers (middleware, balance, timeouts)."""
    sticky: bool
    servers: tuple[Server, ...]
    held: bool = False
    """Requests its servers refuse go to the Python handler (a ``scale_to_zero`` env: held and woken)."""

    def structure(self) -> tuple[object, ...]:
        """What only a reload can change."""
        servers = tuple((s.name, s.addr, s.maxconn, s.cookie) for s in self.servers) if self.sticky else ()
        return (self.name, self.rules, self.held, servers)  # a weight is changed at run time (issue 41)


@dataclass(frozen=True, slots=True)
class Plan:
    hosts: dict[str, str]
    paths: tuple[tuple[str, str], ...]
    backends: dict[str, Backend]
    env_of_backend: dict[str, str] = field(default_factory=dict)

    def same_structure(self, other: Plan) -> bool:
        """Whether ``other`` can be reached from this plan by runtime changes alone."""
        if self.backends.keys() != other.backends.keys() or bool(self.paths) != bool(other.paths):
            return False
        return all(
            mine is other.backends[name] or mine.structure() == other.backends[name].structure()
            for name, mine in self.backends.items()
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Where HAProxy listens and keeps its files, and the timers it gets."""

    directory: Path
    bind: str
    """``HOST:PORT`` of the public listener."""
    hold_addr: str
    """``HOST:PORT`` of the proxy process's Python handler (loopback; the same port for the next proxy process
    while it is free: :data:`HOLD_PORT_FILE`)."""
    hold_timeout: float
    connect_timeout: float
    client_timeout: float = 30.0
    server_timeout: float = 300.0
    shutdown_grace: float = 5.0
    header_timeout: float = 10.0
    """A client must send a request's whole head within this (slow clients get 408 and are closed)."""
    tls_bind: str = ""
    """``HOST:PORT`` of the TLS listener (SNI over the crt-list, ALPN h2 and http/1.1); '' = none."""
    old_worker_lifetime: float = 600.0
    """After a reload, the old worker keeps its open connections (WebSockets) at most this long: the drain
    window, so a connection open during a red/green deploy lives as long as its old replica may."""
    latency_log: bool = False
    """Log each answered request's backend, server, status and time to :attr:`latency_socket` (real latency
    percentiles, :mod:`services.proxy.haproxy_latency`)."""
    latency_log_sample: int = 1
    """Log one request in this many (1: every request)."""
    latency_log_lines: float = 128.0
    """A busy backend logs about this many requests a second (``log_every_map``); 0: every request."""

    @property
    def config_file(self) -> Path:
        return self.directory / "haproxy.cfg"

    @property
    def pid_file(self) -> Path:
        """The HAProxy master's pid (HAProxy's ``-p``): what a proxy process starting after a crash adopts."""
        return self.directory / "haproxy.pid"

    @property
    def hosts_map(self) -> Path:
        return self.directory / "hosts.map"

    @property
    def paths_map(self) -> Path:
        return self.directory / "paths.map"

    @property
    def certs_dir(self) -> Path:
        """One ``<name>.pem`` (chain + key) per installed certificate."""
        return self.directory / "certs"

    @property
    def crt_list(self) -> Path:
        return self.directory / "certs.list"

    @property
    def default_cert(self) -> Path:
        """Served when no certificate matches the SNI (a self-signed one made at first start)."""
        return self.directory / "default.pem"

    @property
    def socket_dir(self) -> Path:
        """``directory``, or a short private one under the temp dir when a socket path there would pass the
        unix limit (108 bytes, and HAProxy binds ``<path>.<pid>.tmp`` first)."""
        if len(str(self.directory)) <= SOCKET_DIR_MAX:
            return self.directory
        digest = hashlib.sha256(str(self.directory).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"zattera-haproxy-{digest}"

    @property
    def stats_socket(self) -> Path:
        return self.socket_dir / "stats.sock"

    @property
    def master_socket(self) -> Path:
        return self.socket_dir / "master.sock"

    @property
    def latency_socket(self) -> Path:
        """Where HAProxy's request log ring forwards its lines (this process listens)."""
        return self.socket_dir / "latency.sock"

    @property
    def log_every_map(self) -> Path:
        """Backend → log one of its requests in N (:func:`services.proxy.haproxy_latency.log_every`); a
        backend not in it logs every request."""
        return self.directory / "log-every.map"


def server_line(server: Server, *, sticky: bool, held: bool = False) -> str:
    line = f"server {server.name} {server.addr} weight {server.weight} {IDLE_POOL}"
    if server.maxconn:
        line += f" maxconn {server.maxconn}"
    if sticky:
        line += f" cookie {server.cookie}"
    if held:
        line += f" check inter {HELD_CHECK_INTER} observe layer4 error-limit 1 on-error mark-down"
    return line


def map_text(entries: Iterable[tuple[str, str]]) -> str:
    return "".join(f"{key} {value}\n" for key, value in entries)


def _frontend_rules(plan_: Plan, layout: Layout) -> list[str]:
    """The frontend's lines: the HTTPS flag (only when a backend redirects), the forwarded headers, then
    its stages in the Python pipeline's order (HAProxy runs every ``http-request`` rule before choosing a
    backend, so those of each stage come first and its ``use_backend`` rules after, in the same order)."""
    host = "req.hdr(host),field(1,:),lower"
    rules = []
    if any(HTTPS_VAR in rule for backend in plan_.backends.values() for rule in backend.rules):
        # As the Python proxy: HTTPS to this listener, or a TLS terminator in front saying so.
        rules.append(
            f"http-request set-var({HTTPS_VAR}) bool(1) if {{ ssl_fc }} || "
            "{ req.hdr(x-forwarded-proto,1),lower -m str https }"
        )
    rules += [
        "http-request set-header X-Forwarded-Proto %[ssl_fc,iif(https,http)]",
        "http-request set-header X-Forwarded-Host %[req.hdr(host)]",
    ]
    # ACME HTTP-01 answers (any host, known or not) are the Python side's, before host matching and
    # before any backend's middleware (an HTTPS redirect must never meet a CA's validation request).
    stages = {"acme_challenge": [f"use_backend {HOLD_BACKEND} if {{ path_beg {CHALLENGE_PATH} }}"], "route_match": []}
    if plan_.paths:
        stages["route_match"] += [
            "http-request set-var(txn.path) path",
            f"http-request set-var(txn.backend) {host},concat(,txn.path,),map_beg({layout.paths_map})",
            "use_backend %[var(txn.backend)] if { var(txn.backend) -m found }",
        ]
    stages["route_match"].append(f"use_backend %[{host},map({layout.hosts_map})]")  # none: default_backend
    ordered = [rule for stage in ORDER if stage in stages for rule in stages[stage]]
    rules += [rule for rule in ordered if rule.startswith("http-request")]
    rules += [rule for rule in ordered if not rule.startswith("http-request")]
    return [f"    {rule}" for rule in rules]


LATENCY_LOG_FORMAT = "%b %s %ST %Ta"
"""Backend, server, status, total active time (ms): all a request log line says (no client, URL or header)."""
LOG_EVERY_VAR = "zt_log_every"
"""The transaction variable holding the current backend's N (log one request in N)."""
LATENCY_RING = "zattera_latency"
LATENCY_RING_SIZE = 1 << 20
"""Bytes HAProxy buffers (~50,000 lines) while the proxy process is busy or its socket is re-created; the
oldest lines are overwritten when full (the data plane never waits for the log)."""


def _latency_ring_lines(layout: Layout) -> list[str]:
    """The ring the request log goes to, forwarded over a unix stream socket, one line per request."""
    if not layout.latency_log:
        return []
    return [
        "",
        f"ring {LATENCY_RING}",
        "    format raw",
        "    maxlen 128",
        f"    size {LATENCY_RING_SIZE}",
        "    timeout connect 1s",
        "    timeout server 1h",
        f"    server proxy unix@{layout.latency_socket}",
        "",
    ]


def _latency_log_lines(layout: Layout) -> list[str]:
    if not layout.latency_log:
        return []
    sample = f" sample 1:{layout.latency_log_sample}" if layout.latency_log_sample > 1 else ""
    return [
        f"    log ring@{LATENCY_RING}{sample} local0 info",
        f'    log-format "{LATENCY_LOG_FORMAT}"',
        '    error-log-format "-"',  # the default names the client and the SNI: nothing of it is wanted
        "    option dontlognull",
        # A busy backend logs one request in N (its entry in the map, set at run time from its rate): the
        # percentiles need a few hundred lines a second, not every request (PERFORMANCE.md, "Latency log").
        f"    http-response set-var(txn.{LOG_EVERY_VAR}) be_name,map_str_int({layout.log_every_map},1)",
        f"    http-response set-log-level silent if {{ rand,mod(txn.{LOG_EVERY_VAR}) -m int gt 0 }}",
    ]


SSL_SESSION_CACHE = 1000
"""TLS sessions HAProxy keeps for session-id resumption (TLS 1.2 clients without tickets: those with tickets, and
TLS 1.3, resume by ticket, without it): its default of 20,000 is ~4.7 MB resident from start, idle or not
(PERFORMANCE.md "A lighter node"); 1,000 (the most recent clients of that kind) ~0.25 MB."""


def render(plan_: Plan, layout: Layout) -> str:
    """The whole configuration: global, defaults, the frontend, the hold backend and every backend with
    its current servers (so a fresh or reloaded HAProxy starts with all routes, before any runtime call)."""
    lines = [
        "global",
        f"    stats socket {layout.stats_socket} mode 600 level admin expose-fd listeners",
        "    stats timeout 30s",
        "    nbthread 1",
        f"    tune.ssl.cachesize {SSL_SESSION_CACHE}",
        f"    hard-stop-after {ms(max(layout.shutdown_grace, 1.0) + layout.old_worker_lifetime)}",
        *_latency_ring_lines(layout),
        "defaults",
        "    mode http",
        "    option http-keep-alive",
        # On a reload, the old worker answers the next request of each idle client connection (with
        # "Connection: close") instead of closing it under a client that may be sending on it.
        "    option idle-close-on-response",
        "    option forwardfor",
        f"    timeout connect {ms(layout.connect_timeout)}",
        f"    timeout client {ms(layout.client_timeout)}",
        f"    timeout server {ms(layout.server_timeout)}",
        f"    timeout http-request {ms(layout.header_timeout)}",
        "    timeout http-keep-alive 30s",
        "    timeout tunnel 1h",
        "    timeout client-fin 5s",
        "",
        "frontend ingress",
        f"    bind {layout.bind}",
        *(
            [f"    bind {layout.tls_bind} ssl crt {layout.default_cert} crt-list {layout.crt_list} alpn h2,http/1.1"]
            if layout.tls_bind
            else []
        ),
        *_frontend_rules(plan_, layout),
        *_latency_log_lines(layout),
        f"    default_backend {NO_ROUTE_BACKEND}",
        "",
        f"backend {HOLD_BACKEND}",
        "    timeout server " + ms(layout.hold_timeout + layout.server_timeout),
        # Refused, the proxy process is restarting: retried a second apart (HAProxy waits min(timeout connect, 1 s)
        # after a refused TCP connection), the request waits for the next one, on the same port, rather than get
        # 503. A GET or HEAD the process died under (no answer) is sent to the next one too; no other method is.
        "    timeout connect 1s",
        f"    retries {HOLD_RETRIES}",
        "    retry-on conn-failure empty-response",
        "    http-request disable-l7-retry if !METH_GET",
        f"    server python {layout.hold_addr}",
        "",
        f"backend {NO_ROUTE_BACKEND}",
        "    " + json_return(404, "no route for host"),
    ]
    for name in sorted(plan_.backends):
        backend = plan_.backends[name]
        lines += ["", f"backend {name}"]
        lines += [f"    {rule}" for rule in backend.rules]
        lines += [f"    {server_line(s, sticky=backend.sticky, held=backend.held)}" for s in backend.servers]
        if backend.held:
            lines.append(f"    server {HOLD_BACKUP_SERVER} {layout.hold_addr} backup")
    return "\n".join(lines) + "\n"
