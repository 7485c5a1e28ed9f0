"""What HAProxy should run for one route table (pure): the :class:`Plan` and the configuration text.

A plan has three parts, changed at run time in different ways (:mod:`services.proxy.haproxy_engine`):

* ``hosts`` — the Host map (``hosts.map``: lowercased hostname → backend name), an O(log n) tree
  lookup per request; changed entry by entry with ``set map``/``add map``/``del map``;
* ``paths`` — hostname + path prefix → backend name for hosts that have path-prefixed routes, longest
  prefix first (``map_beg`` keeps file order); small, rewritten whole with ``prepare map``/``commit map``.
  Its lookup is in the configuration only while there are such routes (having some or none is structure);
* ``backends`` — one per (env, middleware, rate limit, concurrency cap) with its servers. Servers of
  non-sticky backends are added/removed at run time (``add server``/``del server``); anything else that
  differs (a new backend, changed middleware, the servers of a sticky backend: HAProxy 2.6 refuses
  ``cookie`` on dynamic servers) is a *structure* change: a new configuration and a hitless reload.

The frontend does per request only what some route needs, each step a rule HAProxy runs on every request
(valgrind, a keep-alive request: ~38,400 user-space instructions, against ~30,400 for a hand-written host map
to one backend and ~36,600 for one that also sets the same forwarded headers; PERFORMANCE.md has each rule's
share): the forwarded headers, ACME challenges to ``hold``, the path map (only with path-prefixed routes), the
host map in ``use_backend`` itself, ``no_route`` (the JSON 404) by default; ``txn.https`` is computed only
when a backend redirects to HTTPS.

Routes that HAProxy does not serve itself go to the ``hold`` backend, whose one server is the Python
handler (:class:`services.proxy.server.Proxy` on loopback): routes with no healthy endpoint (cold:
hold-and-activate, or the 502 "no healthy endpoint") and routes with basic auth (HAProxy 2.6 checks
bcrypt hashes with crypt(3) on its single event loop, without caching: ~0.1 s of a stalled data plane
per request; the Python handler checks in a thread and remembers logins).

Middleware, in the Python proxy's order (:data:`services.proxy.pipeline.ORDER`, which orders the frontend's and
each backend's rules here too): IP allowlist (403) → HTTPS redirect (308) → rate limit (429) →
body cap (413, declared ``Content-Length``) → sticky cookie → ``balance random(2)`` (power of two
choices; the same-node tie-break is a weight of 101 against 100: HAProxy compares load per weight) with
``maxconn`` = ``max_concurrency`` and ``timeout queue`` = the hold timeout (a full env's requests queue
in HAProxy), ``retry-on conn-failure`` + ``option redispatch`` (a refused connection is retried on
another server). A ``scale_to_zero`` env's backend also has the Python handler as a ``backup`` server, and
its servers are marked down by the first refused connection (``observe layer4``, re-checked every
``HELD_CHECK_INTER``): a request that meets a replica cooled a moment ago, while the snapshot saying so is
on its way, is redispatched to the handler, which holds it and wakes the env, instead of a 503.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.auth import route_users
from services.proxy.balancer import STICKY_COOKIE, sticky_value
from services.proxy.pipeline import ORDER
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH

HOLD_BACKEND = "hold"
HOLD_BACKUP_SERVER = "zattera_hold"
HELD_CHECK_INTER = "2s"
NO_ROUTE_BACKEND = "no_route"
"""Where a request whose host and path match no route goes: the JSON 404, answered by HAProxy."""
HTTPS_VAR = "txn.https"
LOCAL_WEIGHT = 101
REMOTE_WEIGHT = 100
RATE_TABLE_SIZE = "32k"
RATE_TABLE_EXPIRE = "120s"
SOCKET_DIR_MAX = 70
IDLE_POOL = "pool-max-conn -1 pool-purge-delay 5s"
"""Every server keeps its idle backend connections for reuse (no limit; half of the unused ones closed every
5 s). Configured servers get these values by default, but a server added at run time (``add server``, how
endpoints arrive) gets none in HAProxy 2.6 (``show servers conn``: ``idle_lim 0``): each request would open a
new backend connection, at three times the CPU per request. Spelled out on every line for both paths."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _json_return(status: int, message: str, *headers: str) -> str:
    extra = "".join(f" hdr {name} {value}" for name, value in (h.split(":", 1) for h in headers))
    return (
        f'http-request return status {status} content-type application/json string \'{{"error":"{message}"}}\'{extra}'
    )


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
    """``HOST:PORT`` of the Python hold handler."""
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

    @property
    def config_file(self) -> Path:
        return self.directory / "haproxy.cfg"

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


def backend_name(route: cpb.HTTPRoute) -> str:
    """Stable per (env, middleware, rate limit, cap): equal routes share a backend across snapshots."""
    signature = hashlib.sha1(usedforsecurity=False)
    for part in (route.middleware, route.rate_limit):
        signature.update(part.SerializeToString(deterministic=True))
        signature.update(b"|")
    signature.update(str(route.max_concurrency).encode())
    return f"env_{_UNSAFE.sub('_', route.environment_id)}_{signature.hexdigest()[:10]}"


def server_name(endpoint: cpb.Endpoint) -> str:
    return "s_" + _UNSAFE.sub("_", endpoint.assignment_id or endpoint.addr)


def _allowlist(entries: Iterable[str]) -> list[str]:
    networks: list[str] = []
    for entry in entries:
        try:
            networks.append(str(ipaddress.ip_network(entry.strip(), strict=False)))
        except ValueError:
            continue  # invalid entries are dropped, as the Python proxy does
    return networks


def _allowlist_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not middleware.ip_allowlist:
        return []
    networks = _allowlist(middleware.ip_allowlist)
    condition = f" unless {{ src {' '.join(networks)} }}" if networks else ""
    return [_json_return(403, "forbidden") + condition]


def _https_redirect_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not middleware.redirect_https:
        return []
    return [f"http-request redirect scheme https code 308 unless {{ var({HTTPS_VAR}) -m bool }}"]


def _rate_limit_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not (route.HasField("rate_limit") and route.rate_limit.requests_per_second > 0):
        return []
    allowed = max(route.rate_limit.burst, route.rate_limit.requests_per_second)
    return [
        f"stick-table type ipv6 size {RATE_TABLE_SIZE} expire {RATE_TABLE_EXPIRE} store http_req_rate(1s)",
        "http-request track-sc0 src",
        _json_return(429, "rate limit exceeded", "Retry-After:1") + f" if {{ sc_http_req_rate(0) gt {allowed} }}",
    ]


def _body_cap_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not middleware.max_body_bytes:
        return []
    return [
        _json_return(413, "request body too large")
        + f" if {{ req.hdr_val(content-length) gt {middleware.max_body_bytes} }}"
    ]


def is_weighted(route: cpb.HTTPRoute) -> bool:
    """A canary's route (issue 41): servers weighted by their release's share, users pinned by cookie."""
    return bool(route.endpoints) and bool(route.endpoints[0].step_tag)


def _endpoint_choice_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not (middleware.sticky_sessions or is_weighted(route)):
        return []  # ``balance random(2)`` and the queue are the backend's own lines
    return [f"cookie {STICKY_COOKIE} insert indirect nocache httponly attr SameSite=Lax"]


BACKEND_STAGES: dict[str, Callable[[cpb.HTTPRoute, pb.Middleware], list[str]]] = {
    "allowlist": _allowlist_rules,
    "https_redirect": _https_redirect_rules,
    "rate_limit": _rate_limit_rules,
    "body_cap": _body_cap_rules,
    "endpoint_choice": _endpoint_choice_rules,
}
"""The Python pipeline's middleware a backend applies itself, each one's rules (in :data:`ORDER`)."""
FRONTEND_STAGES = ("acme_challenge", "route_match")
"""Stages the frontend runs for every request, before any backend's (their rules: :func:`_frontend_rules`)."""
ELSEWHERE = {
    "basic_auth": "a route with users is served by the Python handler (the hold backend)",
    "forward": "the backend's servers",
}
"""Stages with no rule of their own, and what does their work."""


def backend_rules(route: cpb.HTTPRoute, hold_timeout: float) -> tuple[str, ...]:
    """A backend's lines besides its servers: balance, retries and the queue, then its middleware in the
    Python pipeline's order, then compression (applied to the response)."""
    middleware = route.middleware if route.HasField("middleware") else pb.Middleware()
    rules = [
        # A canary's shares hold only when the draw follows the weights alone (P2C would favour the release
        # with fewer requests in flight: the canary).
        "balance random(1)" if is_weighted(route) else "balance random(2)",
        "option redispatch 1",
        "retries 3",
        # A scale-to-zero env's replica may die under a request (cooled while the snapshot saying so was on
        # its way): a GET or HEAD it closed without answering is sent again (to the hold backend, once the
        # dead server's refused connection has marked it down); nothing else is replayed.
        "retry-on conn-failure empty-response" if route.scale_to_zero else "retry-on conn-failure",
        *(["http-request disable-l7-retry unless METH_GET"] if route.scale_to_zero else []),
        f"timeout queue {ms(hold_timeout)}",
    ]
    for stage in ORDER:
        if stage in BACKEND_STAGES:
            rules += BACKEND_STAGES[stage](route, middleware)
    if middleware.compress:
        rules.append("compression algo gzip")
    return tuple(rules)


MAX_WEIGHT = 256


def canary_weights(endpoints: Sequence[cpb.Endpoint]) -> dict[str, int]:
    """Server weight per endpoint address of a weighted route: its release's share split over the
    release's servers, as integers ≤ :data:`MAX_WEIGHT` (HAProxy's bound) at least 1 for a share above 0,
    the largest between 128 and 256 chosen so the rounded shares come closest to the exact ones (issue 41)."""
    counts: dict[str, int] = {}
    for e in endpoints:
        counts[e.release_id] = counts.get(e.release_id, 0) + 1
    raw = {e.addr: e.release_weight / counts[e.release_id] for e in endpoints}
    top = max(raw.values(), default=0.0)
    if top <= 0:
        return {addr: REMOTE_WEIGHT for addr in raw}
    total = sum(raw.values())
    best: tuple[float, dict[str, int]] | None = None
    for scale in range(MAX_WEIGHT, MAX_WEIGHT // 2 - 1, -1):
        weights = {addr: max(1, round(value * scale / top)) if value > 0 else 0 for addr, value in raw.items()}
        given = sum(weights.values())
        error = max(abs(weights[addr] / given - value / total) for addr, value in raw.items())
        if best is None or error < best[0]:
            best = (error, weights)
    assert best is not None
    return best[1]


def _servers(route: cpb.HTTPRoute, node_id: str) -> tuple[Server, ...]:
    weights = canary_weights([e for e in route.endpoints if e.healthy and e.addr]) if is_weighted(route) else {}
    servers = {
        server_name(e): Server(
            name=server_name(e),
            addr=e.addr,
            weight=weights.get(e.addr) or (LOCAL_WEIGHT if node_id and e.node_id == node_id else REMOTE_WEIGHT),
            maxconn=route.max_concurrency,
            cookie=sticky_value(e),
            release_id=e.release_id,
            step_tag=e.step_tag,
        )
        for e in route.endpoints
        if e.healthy and e.addr
    }
    return tuple(servers[name] for name in sorted(servers))


def path_key(hostname: str, prefix: str) -> str | None:
    """The ``paths.map`` key of a route (None: a prefix not starting with ``/`` never matches a path)."""
    if not prefix:
        return hostname + "/"
    return hostname + prefix if prefix.startswith("/") else None


RouteCache = dict[bytes, tuple[str, str, "Backend | None", "Backend | None"]]
"""Serialized route → (lowercased hostname, path prefix, the backend serving it — None: the Python
handler —, the backend kept for it). Routes that did
not change between two snapshots are not planned again, and their Backend objects stay identical (cheap
comparisons): a snapshot of 10,000 routes with one changed costs one serialization per route."""


def _plan_route(
    route: cpb.HTTPRoute, node_id: str, hold_timeout: float
) -> tuple[str, str, Backend | None, Backend | None]:
    """(hostname, prefix, the backend requests go to — None: the Python handler —, the backend to keep). A
    cold route keeps its (empty) backend, so going cold and warming up again are runtime changes."""
    hostname, prefix = route.hostname.lower(), route.path_prefix
    if route.HasField("middleware") and route_users(route.middleware):
        return hostname, prefix, None, None
    sticky = (route.HasField("middleware") and route.middleware.sticky_sessions) or is_weighted(route)
    servers = _servers(route, node_id)
    rules = backend_rules(route, hold_timeout)
    backend = Backend(backend_name(route), route.environment_id, rules, sticky, servers, held=route.scale_to_zero)
    return hostname, prefix, backend if servers else None, backend


def plan(snapshot: cpb.RouteSnapshot, *, node_id: str, hold_timeout: float, cache: RouteCache | None = None) -> Plan:
    """The plan of a snapshot. ``cache`` (optional) is read and replaced by this snapshot's routes."""
    previous = cache.copy() if cache is not None else {}
    current: RouteCache = {}
    backends: dict[str, Backend] = {}
    targets: list[tuple[str, str, str]] = []  # (hostname, prefix, backend)
    hold = HOLD_BACKEND
    for route in snapshot.http_routes:
        key = route.SerializeToString(deterministic=True)
        planned = previous.get(key) or _plan_route(route, node_id, hold_timeout)
        current[key] = planned
        hostname, prefix, serving, kept = planned
        if kept is not None and kept.name not in backends:
            backends[kept.name] = kept
        targets.append((hostname, prefix, serving.name if serving is not None else hold))
    if cache is not None:
        cache.clear()
        cache.update(current)
    prefixed = {hostname for hostname, prefix, _ in targets if prefix}
    hosts: dict[str, str] = {}
    paths: list[tuple[str, str, int]] = []
    for order, (hostname, prefix, name) in enumerate(targets):
        if hostname not in prefixed:
            hosts.setdefault(hostname, name)
            continue
        path = path_key(hostname, prefix)
        if path is not None:
            paths.append((path, name, order))
    paths.sort(key=lambda entry: (-len(entry[0]), entry[2]))  # longest first, snapshot order on ties
    ordered: dict[str, str] = {}
    for path, name, _ in paths:
        ordered.setdefault(path, name)
    return Plan(hosts, tuple(ordered.items()), backends, {name: b.env_id for name, b in backends.items()})


def server_line(server: Server, *, sticky: bool, held: bool = False) -> str:
    line = f"server {server.name} {server.addr} weight {server.weight} {IDLE_POOL}"
    if server.maxconn:
        line += f" maxconn {server.maxconn}"
    if sticky:
        line += f" cookie {server.cookie}"
    if held:
        line += f" check inter {HELD_CHECK_INTER} observe layer4 error-limit 1 on-error mark-down"
    return line


def ms(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


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
        f"    server python {layout.hold_addr}",
        "",
        f"backend {NO_ROUTE_BACKEND}",
        "    " + _json_return(404, "no route for host"),
    ]
    for name in sorted(plan_.backends):
        backend = plan_.backends[name]
        lines += ["", f"backend {name}"]
        lines += [f"    {rule}" for rule in backend.rules]
        lines += [f"    {server_line(s, sticky=backend.sticky, held=backend.held)}" for s in backend.servers]
        if backend.held:
            lines.append(f"    server {HOLD_BACKUP_SERVER} {layout.hold_addr} backup")
    return "\n".join(lines) + "\n"
