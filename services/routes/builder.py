"""RouteBuilder: the routing table as a pure function of the state view.

Construction: per environment
(sorted by id) whose app exists, one HTTP route per explicit domain of the env's project attached to
it (domain id order), then the implicit ``<app>-<env>.<domain>`` route — only towards an HTTP port: an env
whose ports are all TCP/UDP gets no HTTP route (nor a certificate); L4 routes for ports with a
public port; an internal service when the env holds a VIP; endpoints are the active release's RUN
replicas observed HEALTHY with a bound mesh port on a node that is present and not DOWN/DRAINED.

Incremental: the snapshot is kept as per-environment fragments, each already in wire encoding
(written by hand, :mod:`services.routes.wire`, several times cheaper than building message objects),
and the snapshot bytes are their concatenation. Protobuf's wire format makes this exact: a message's
deterministic encoding is its fields in number order, a repeated field being its elements' encodings
back to back, so ``version`` + every env's ``http_routes`` + every env's ``l4_routes`` + every env's
``internal_services`` + ``cert_hosts`` + ``cluster`` + ``control_version`` is byte for byte
``SerializeToString(deterministic=True)`` of the whole snapshot. A change rebuilds only the environments
whose inputs it touches:

* env, vip → that env;  app, project → the envs of that app / project;
* domain → the env it is attached to now and the one it was attached to before;
* assignment (the view also reports observed reports joined into it) → its env, old and new;
* node (status, mesh IP) → every env with an assignment on that node.

App and Project changes are watched (a rename reaches the routes at once, not on the tick), and the
build is atomic (it runs between two view updates, never across one).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.wire import (
    LEN,
    VARINT,
    bool_field,
    len_field,
    message_field,
    repeated_field,
    sized,
    string_field,
    tag,
    uint_field,
)
from shared import keys as K
from shared.state.changes import Change
from shared.state.reader import StateReader
from shared.version import VERSION

RELEVANT_KINDS = frozenset({K.ENV, K.APP, K.PROJECT, K.DOMAIN, K.ASSIGNMENT, K.OBSERVED, K.NODE, K.VIP})
"""Every kind the snapshot reads; the snapshot version is the newest revision among them."""

L4_PROTOCOL = "tcp"  # L4 and internal ports are "tcp" on the wire, even for UDP (proxies forward TCP only)
DEFAULT_HTTP_PORT = "http"
FALLBACK_HOST = "127.0.0.1"
_UNROUTABLE_NODE_STATUSES = frozenset({pb.NODE_STATUS_DOWN, pb.NODE_STATUS_DRAINED})
_RUN = pb.ASSIGNMENT_DESIRED_RUN
_HEALTHY = pb.INSTANCE_STATE_HEALTHY
_HTTP_PROTOCOLS = frozenset({pb.PROTOCOL_HTTP, pb.PROTOCOL_UNSPECIFIED})


def http_port_name(spec: pb.ServiceSpec) -> str:
    """First HTTP (or unspecified) port; ``"http"`` when the spec declares no port; "" when it declares only
    TCP/UDP ports: such an env gets no HTTP route (a raw TCP service would otherwise get an implicit
    hostname, a certificate and 502s)."""
    for port in spec.ports:
        if port.protocol in _HTTP_PROTOCOLS:
            return port.name
    return "" if spec.ports else DEFAULT_HTTP_PORT


def routes_http(spec: pb.ServiceSpec, port_name: str) -> bool:
    """Whether an HTTP route may send traffic to ``port_name``: not "" and not a declared TCP/UDP port."""
    return bool(port_name) and not any(p.name == port_name and p.protocol not in _HTTP_PROTOCOLS for p in spec.ports)


def implicit_hostname(app_name: str, env_name: str, domain: str) -> str:
    """``<app>-<env>.<domain>``, verbatim (no sanitizing or lowercasing: names are validated lowercase already)."""
    return f"{app_name}-{env_name}.{domain}"


def internal_fqdn(app_name: str, env_name: str, project_name: str) -> str:
    """``<app>.<env>.<project>.internal.`` with the trailing dot."""
    return f"{app_name}.{env_name}.{project_name}.internal."


def bound_port(assignment: pb.Assignment, observed: pb.AssignmentObserved, port_name: str) -> int:
    """The published mesh port of ``port_name``: the agent's observed report first, then the desired record."""
    return observed.mesh_port_bindings.get(port_name, 0) or assignment.mesh_port_bindings.get(port_name, 0)


def routable_host(node: pb.Node | None) -> str | None:
    """The address endpoints on ``node`` use (mesh IP, else 127.0.0.1); None when the node is missing,
    DOWN or DRAINED (SUSPECT and DRAINING keep their endpoints: a drain moves replicas off first)."""
    if node is None or node.status in _UNROUTABLE_NODE_STATUSES:
        return None
    return node.mesh_ip or FALLBACK_HOST


NodeHosts = Mapping[str, str | None]
"""node id -> :func:`routable_host` of that node (a missing id is a missing node)."""


def node_hosts(view: StateReader) -> dict[str, str | None]:
    return {node.meta.id: routable_host(node) for node in view.nodes()}


Replica = tuple[pb.Assignment, pb.AssignmentObserved, str]
"""A replica that may carry traffic: its assignment, the observed report joined into it, its host."""


def routable_replicas(view: StateReader, env: pb.Environment, hosts: NodeHosts) -> list[Replica]:
    """The env's assignments, by id, that may carry traffic: the active release only, desired RUN,
    observed HEALTHY exactly, on a routable node. A bound port depends on the port: see
    :class:`_Endpoints`."""
    active = env.active_release_id
    if not active:
        return []
    replicas = []
    for assignment in view.assignments(env.meta.id):
        if assignment.release_id == active and assignment.desired == _RUN:
            observed = assignment.observed
            if observed.state == _HEALTHY and (host := hosts.get(assignment.node_id)):
                replicas.append((assignment, observed, host))
    return replicas


# Field keys of the route messages (cluster.proto), for the hand-written encoding (see services/routes/wire.py).
_HTTP_ROUTE = tag(cpb.RouteSnapshot.HTTP_ROUTES_FIELD_NUMBER, LEN)
_L4_ROUTE = tag(cpb.RouteSnapshot.L4_ROUTES_FIELD_NUMBER, LEN)
_INTERNAL_SERVICE = tag(cpb.RouteSnapshot.INTERNAL_SERVICES_FIELD_NUMBER, LEN)
_ENDPOINT_ASSIGNMENT = tag(cpb.Endpoint.ASSIGNMENT_ID_FIELD_NUMBER, LEN)
_ENDPOINT_NODE = tag(cpb.Endpoint.NODE_ID_FIELD_NUMBER, LEN)
_ENDPOINT_ADDR = tag(cpb.Endpoint.ADDR_FIELD_NUMBER, LEN)
_ENDPOINT_HEALTHY = tag(cpb.Endpoint.HEALTHY_FIELD_NUMBER, VARINT)
_ROUTE_HOSTNAME = tag(cpb.HTTPRoute.HOSTNAME_FIELD_NUMBER, LEN)
_ROUTE_PATH_PREFIX = tag(cpb.HTTPRoute.PATH_PREFIX_FIELD_NUMBER, LEN)
_ROUTE_PROJECT = tag(cpb.HTTPRoute.PROJECT_ID_FIELD_NUMBER, LEN)
_ROUTE_APP = tag(cpb.HTTPRoute.APP_ID_FIELD_NUMBER, LEN)
_ROUTE_ENV = tag(cpb.HTTPRoute.ENVIRONMENT_ID_FIELD_NUMBER, LEN)
_ROUTE_APP_NAME = tag(cpb.HTTPRoute.APP_NAME_FIELD_NUMBER, LEN)
_ROUTE_ENV_NAME = tag(cpb.HTTPRoute.ENVIRONMENT_NAME_FIELD_NUMBER, LEN)
_ROUTE_MIDDLEWARE = tag(cpb.HTTPRoute.MIDDLEWARE_FIELD_NUMBER, LEN)
_ROUTE_ENDPOINT = tag(cpb.HTTPRoute.ENDPOINTS_FIELD_NUMBER, LEN)
_ROUTE_SCALE_TO_ZERO = tag(cpb.HTTPRoute.SCALE_TO_ZERO_FIELD_NUMBER, VARINT)
_ROUTE_MAX_CONCURRENCY = tag(cpb.HTTPRoute.MAX_CONCURRENCY_FIELD_NUMBER, VARINT)
_ROUTE_GENERATION = tag(cpb.HTTPRoute.ROUTE_GENERATION_FIELD_NUMBER, VARINT)
_ROUTE_RATE_LIMIT = tag(cpb.HTTPRoute.RATE_LIMIT_FIELD_NUMBER, LEN)
_L4_PUBLIC_PORT = tag(cpb.L4Route.PUBLIC_PORT_FIELD_NUMBER, VARINT)
_L4_PROTOCOL = tag(cpb.L4Route.PROTOCOL_FIELD_NUMBER, LEN)
_L4_ENV = tag(cpb.L4Route.ENVIRONMENT_ID_FIELD_NUMBER, LEN)
_L4_ENDPOINT = tag(cpb.L4Route.ENDPOINTS_FIELD_NUMBER, LEN)
_SERVICE_FQDN = tag(cpb.InternalService.FQDN_FIELD_NUMBER, LEN)
_SERVICE_PROJECT = tag(cpb.InternalService.PROJECT_ID_FIELD_NUMBER, LEN)
_SERVICE_ENV = tag(cpb.InternalService.ENVIRONMENT_ID_FIELD_NUMBER, LEN)
_SERVICE_VIP = tag(cpb.InternalService.VIP_FIELD_NUMBER, LEN)
_SERVICE_PORT = tag(cpb.InternalService.PORTS_FIELD_NUMBER, LEN)
_SERVICE_SCALE_TO_ZERO = tag(cpb.InternalService.SCALE_TO_ZERO_FIELD_NUMBER, VARINT)
_PORT_NAME = tag(cpb.InternalPort.NAME_FIELD_NUMBER, LEN)
_PORT_NUMBER = tag(cpb.InternalPort.PORT_FIELD_NUMBER, VARINT)
_PORT_PROTOCOL = tag(cpb.InternalPort.PROTOCOL_FIELD_NUMBER, LEN)
_PORT_ENDPOINT = tag(cpb.InternalPort.ENDPOINTS_FIELD_NUMBER, LEN)
_HEALTHY_TRUE = bool_field(_ENDPOINT_HEALTHY, True)
_L4_TCP = string_field(_L4_PROTOCOL, L4_PROTOCOL)
_PORT_TCP = string_field(_PORT_PROTOCOL, L4_PROTOCOL)


class _Endpoints:
    """A route's encoded endpoints for a port: each replica's endpoint is encoded once per port, then
    framed as elements of whichever repeated field carries it."""

    def __init__(self, replicas: list[Replica]) -> None:
        self._replicas = replicas
        self._sized: dict[str, list[bytes]] = {}

    def encoded(self, port_name: str, field_tag: bytes) -> bytes:
        """The endpoints of ``port_name`` as elements of the repeated field keyed ``field_tag``."""
        if not self._replicas:
            return b""
        elements = self._sized.get(port_name)
        if elements is None:
            elements = self._sized[port_name] = []
            for assignment, observed, host in self._replicas:
                port = bound_port(assignment, observed, port_name)
                if port:
                    endpoint = (
                        string_field(_ENDPOINT_ASSIGNMENT, assignment.meta.id)
                        + string_field(_ENDPOINT_NODE, assignment.node_id)
                        + string_field(_ENDPOINT_ADDR, f"{host}:{port}")
                        + _HEALTHY_TRUE
                    )
                    elements.append(sized(endpoint))
        return repeated_field(field_tag, elements)


@dataclass(frozen=True, slots=True)
class EnvRoutes:
    """One environment's share of the snapshot, each section already in its wire encoding: the env's
    ``http_routes``, ``l4_routes`` and ``internal_services`` elements as they appear in a RouteSnapshot."""

    http: bytes
    l4: bytes
    internal: bytes
    hostnames: tuple[str, ...]


def build_env_routes(view: StateReader, env: pb.Environment, domain: str, hosts: NodeHosts) -> EnvRoutes | None:
    """One environment's routes, encoded; None when its app is missing (the whole env is skipped: it is
    being deleted). ``hosts``: :func:`node_hosts` of the view, kept up to date by the caller."""
    app = view.app(env.app_id)
    if app is None:
        return None
    env_id, project_id, app_id, env_name, app_name = env.meta.id, env.project_id, env.app_id, env.name, app.name
    spec = env.service
    endpoints = _Endpoints(routable_replicas(view, env, hosts))
    http_port = http_port_name(spec)
    # Fields 3–7 and 10–13 are the same on every HTTP route of the env.
    route_ids = b"".join(
        (
            string_field(_ROUTE_PROJECT, project_id),
            string_field(_ROUTE_APP, app_id),
            string_field(_ROUTE_ENV, env_id),
            string_field(_ROUTE_APP_NAME, app_name),
            string_field(_ROUTE_ENV_NAME, env_name),
        )
    )
    route_flags = b"".join(
        (
            bool_field(_ROUTE_SCALE_TO_ZERO, spec.scale_to_zero),
            uint_field(_ROUTE_MAX_CONCURRENCY, spec.max_concurrency),
            uint_field(_ROUTE_GENERATION, env.route_generation),
            message_field(_ROUTE_RATE_LIMIT, spec.rate_limit if spec.HasField("rate_limit") else None),
        )
    )
    http: list[bytes] = []
    hostnames: list[str] = []

    def add_http_route(hostname: str, path_prefix: str, middleware: pb.Middleware | None, port_name: str) -> None:
        route = b"".join(
            (
                string_field(_ROUTE_HOSTNAME, hostname),
                string_field(_ROUTE_PATH_PREFIX, path_prefix),
                route_ids,
                message_field(_ROUTE_MIDDLEWARE, middleware),
                endpoints.encoded(port_name, _ROUTE_ENDPOINT),
                route_flags,
            )
        )
        http.append(len_field(_HTTP_ROUTE, route))
        hostnames.append(hostname)

    # The env's middleware covers every hostname of the env, the implicit one too (else an allowlist or
    # basic auth set in zattera.toml could be walked around through <app>-<env>.<domain>); a domain's own
    # middleware, when it has one, replaces it for that domain.
    env_middleware = env.middleware if env.HasField("middleware") else None
    for dom in view.domains(env_id):
        if dom.project_id == project_id and routes_http(spec, dom.port_name or http_port):
            middleware = dom.middleware if dom.HasField("middleware") else env_middleware
            add_http_route(dom.hostname, dom.path_prefix, middleware, dom.port_name or http_port)
    if domain and http_port:
        add_http_route(implicit_hostname(app_name, env_name, domain), "", env_middleware, http_port)

    l4 = [
        len_field(
            _L4_ROUTE,
            b"".join(
                (
                    uint_field(_L4_PUBLIC_PORT, port.public_l4_port),
                    _L4_TCP,
                    string_field(_L4_ENV, env_id),
                    endpoints.encoded(port.name, _L4_ENDPOINT),
                )
            ),
        )
        for port in spec.ports
        if port.public_l4_port
    ]

    internal = b""
    vip = view.vip(env_id)
    if vip is not None and vip.vip:
        project = view.project(project_id)
        fqdn = internal_fqdn(app_name, env_name, project.name if project is not None else project_id)
        service = [
            string_field(_SERVICE_FQDN, fqdn),
            string_field(_SERVICE_PROJECT, project_id),
            string_field(_SERVICE_ENV, env_id),
            string_field(_SERVICE_VIP, vip.vip),
        ]
        for port in spec.ports:
            internal_port = b"".join(
                (
                    string_field(_PORT_NAME, port.name),
                    uint_field(_PORT_NUMBER, port.container_port),
                    _PORT_TCP,
                    endpoints.encoded(port.name, _PORT_ENDPOINT),
                )
            )
            service.append(len_field(_SERVICE_PORT, internal_port))
        service.append(bool_field(_SERVICE_SCALE_TO_ZERO, spec.scale_to_zero))
        internal = len_field(_INTERNAL_SERVICE, b"".join(service))
    return EnvRoutes(b"".join(http), b"".join(l4), internal, tuple(hostnames))


def encode_snapshot(version: int, content: bytes) -> bytes:
    """The snapshot bytes: ``version`` (field 1, so first) followed by the version-less content."""
    return cpb.RouteSnapshot(version=version).SerializeToString(deterministic=True) + content


class RouteBuilder:
    """Keeps the route snapshot of a view up to date, rebuilding only the environments a change touches.

    Call :meth:`rebuild_all` once the view is loaded, then :meth:`apply_changes` with the view's change
    feed (kinds :data:`RELEVANT_KINDS`). :meth:`content` is the version-less snapshot encoding;
    :attr:`revision` the state revision it reflects.
    """

    def __init__(self, view: StateReader, *, domain: str, cluster: cpb.ClusterIdentity | None = None) -> None:
        self.view = view
        self.domain = domain
        self.envs_rebuilt = 0
        self.cluster = cluster if cluster is not None else cpb.ClusterIdentity()
        self._reset()

    @property
    def cluster(self) -> cpb.ClusterIdentity:
        """The cluster the snapshot names (``RouteSnapshot.cluster``, after ``cert_hosts``: in the content's tail)."""
        return cpb.RouteSnapshot.FromString(self._tail).cluster

    @cluster.setter
    def cluster(self, identity: cpb.ClusterIdentity) -> None:
        # The last fields, in number order: cluster (330), then the routes leader's version (440).
        snapshot = cpb.RouteSnapshot(control_version=VERSION)
        if identity.ByteSize():  # unnamed (tests, a bare builder): the field is left out
            snapshot.cluster.CopyFrom(identity)
        self._tail = snapshot.SerializeToString(deterministic=True)
        self._content: bytes | None = None

    def _reset(self) -> None:
        self._routes: dict[str, EnvRoutes] = {}
        self._order: list[str] = []  # ids of the envs with routes, sorted
        # Each env's sections, aligned with _order: the snapshot is their concatenation.
        self._http_parts: list[bytes] = []
        self._l4_parts: list[bytes] = []
        self._internal_parts: list[bytes] = []
        self._node_hosts: dict[str, str | None] = {}
        self._host_refs: dict[str, int] = {}  # hostname -> number of routes carrying it
        self._cert_hosts: list[str] = []  # the keys of _host_refs, sorted
        self._cert_hosts_bytes: bytes | None = None
        self._content = None
        # Dependency indexes: which envs a change of a given object affects.
        self._env_inputs: dict[str, tuple[str, str]] = {}  # env -> (app_id, project_id)
        self._envs_by_app: dict[str, set[str]] = defaultdict(set)
        self._envs_by_project: dict[str, set[str]] = defaultdict(set)
        self._domain_env: dict[str, str] = {}
        # assignment -> env, to find the env of an assignment the view no longer holds
        self._assignment_env: dict[str, str] = {}

    # ------------------------------------------------------------------ reading

    @property
    def revision(self) -> int:
        """Newest state revision (put or delete) among the kinds the snapshot reads."""
        return max(self.view.kind_revision(kind) for kind in RELEVANT_KINDS)

    def content(self) -> bytes:
        """The snapshot without its version (which :func:`encode_snapshot` prepends)."""
        if self._content is None:
            if self._cert_hosts_bytes is None:
                self._cert_hosts_bytes = cpb.RouteSnapshot(cert_hosts=self._cert_hosts).SerializeToString(
                    deterministic=True
                )
            sections = (self._http_parts, self._l4_parts, self._internal_parts)
            self._content = b"".join([*(b"".join(parts) for parts in sections), self._cert_hosts_bytes, self._tail])
        return self._content

    def snapshot(self, version: int | None = None) -> cpb.RouteSnapshot:
        """The snapshot as a message (tests, CLI); ``version`` defaults to :attr:`revision`."""
        snapshot = cpb.RouteSnapshot()
        snapshot.ParseFromString(encode_snapshot(self.revision if version is None else version, self.content()))
        return snapshot

    # ------------------------------------------------------------------ building

    def rebuild_all(self) -> None:
        """Forget everything and build every environment from the view."""
        self._reset()
        self._node_hosts = node_hosts(self.view)
        self._assignment_env = {a.meta.id: a.environment_id for a in self.view.assignments()}
        for dom in self.view.domains():
            self._domain_env[dom.meta.id] = dom.environment_id
        for env in self.view.envs():
            env_id = env.meta.id
            self.envs_rebuilt += 1
            self._index_env(env_id, env)
            routes = build_env_routes(self.view, env, self.domain, self._node_hosts)
            if routes is not None:
                self._routes[env_id] = routes
                for host in routes.hostnames:
                    self._host_refs[host] = self._host_refs.get(host, 0) + 1
        self._order = sorted(self._routes)
        ordered = [self._routes[env_id] for env_id in self._order]
        self._http_parts = [routes.http for routes in ordered]
        self._l4_parts = [routes.l4 for routes in ordered]
        self._internal_parts = [routes.internal for routes in ordered]
        self._cert_hosts = sorted(self._host_refs)

    def apply_changes(self, changes: Iterable[Change]) -> set[str]:
        """Rebuild the environments affected by ``changes``; returns their ids."""
        affected: set[str] = set()
        for kind, ident in changes:
            if kind in (K.ENV, K.VIP):
                affected.add(ident)
            elif kind == K.APP:
                affected |= self._envs_by_app.get(ident, set())
            elif kind == K.PROJECT:
                affected |= self._envs_by_project.get(ident, set())
            elif kind == K.DOMAIN:
                affected |= self._move_domain(ident)
            elif kind in (K.ASSIGNMENT, K.OBSERVED):
                affected |= self._place_assignment(ident, self.view.assignment(ident))
            elif kind == K.NODE:
                host = routable_host(self.view.node(ident))
                if self._node_hosts.get(ident) != host:
                    self._node_hosts[ident] = host
                    affected |= {a.environment_id for a in self.view.assignments_by_node(ident)}
        for env_id in affected:
            self._rebuild_env(env_id)
        return affected

    def _move_domain(self, domain_id: str) -> set[str]:
        affected = set()
        before = self._domain_env.pop(domain_id, None)
        if before is not None:
            affected.add(before)
        dom = self.view.get(K.DOMAIN, domain_id)
        if isinstance(dom, pb.Domain):
            self._domain_env[domain_id] = dom.environment_id
            affected.add(dom.environment_id)
        return affected

    def _place_assignment(self, assignment_id: str, assignment: pb.Assignment | None) -> set[str]:
        affected = set()
        before = self._assignment_env.pop(assignment_id, None)
        if before is not None:
            affected.add(before)
        if assignment is not None:
            self._assignment_env[assignment_id] = assignment.environment_id
            affected.add(assignment.environment_id)
        return affected

    def _rebuild_env(self, env_id: str) -> None:
        self.envs_rebuilt += 1
        env = self.view.env(env_id)
        self._index_env(env_id, env)
        routes = build_env_routes(self.view, env, self.domain, self._node_hosts) if env is not None else None
        old = self._routes.get(env_id)
        if routes == old:
            return
        self._content = None
        at = bisect.bisect_left(self._order, env_id)
        if routes is None:
            del self._routes[env_id]
            for sequence in (self._order, self._http_parts, self._l4_parts, self._internal_parts):
                del sequence[at]
        else:
            if old is None:
                self._order.insert(at, env_id)
                for parts in (self._http_parts, self._l4_parts, self._internal_parts):
                    parts.insert(at, b"")
            self._routes[env_id] = routes
            self._http_parts[at], self._l4_parts[at], self._internal_parts[at] = routes.http, routes.l4, routes.internal
        old_hosts = old.hostnames if old is not None else ()
        new_hosts = routes.hostnames if routes is not None else ()
        if old_hosts != new_hosts:
            self._forget_cert_hosts(old_hosts)
            self._remember_cert_hosts(new_hosts)

    def _index_env(self, env_id: str, env: pb.Environment | None) -> None:
        before = self._env_inputs.pop(env_id, None)
        if before is not None:
            self._envs_by_app[before[0]].discard(env_id)
            self._envs_by_project[before[1]].discard(env_id)
        if env is not None:
            self._env_inputs[env_id] = (env.app_id, env.project_id)
            self._envs_by_app[env.app_id].add(env_id)
            self._envs_by_project[env.project_id].add(env_id)

    def _remember_cert_hosts(self, hostnames: Iterable[str]) -> None:
        for host in hostnames:
            refs = self._host_refs.get(host, 0)
            self._host_refs[host] = refs + 1
            if not refs:
                bisect.insort(self._cert_hosts, host)
                self._cert_hosts_bytes = None

    def _forget_cert_hosts(self, hostnames: Iterable[str]) -> None:
        for host in hostnames:
            refs = self._host_refs[host] - 1
            if refs:
                self._host_refs[host] = refs
            else:
                del self._host_refs[host]
                del self._cert_hosts[bisect.bisect_left(self._cert_hosts, host)]
                self._cert_hosts_bytes = None
