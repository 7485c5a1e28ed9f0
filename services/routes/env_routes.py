"""One environment's routes, a pure function of the state view, already in wire encoding (written by hand,
:mod:`services.routes.wire`): its HTTP routes (explicit domains, then the implicit
``<app>-<env>.<domain>`` one, towards an HTTP port only), L4 routes and internal service, with the endpoints
that may take traffic. :class:`services.routes.builder.RouteBuilder` keeps one such fragment per env."""

from __future__ import annotations

from collections.abc import Mapping
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
from shared.canary import release_weights, step_tag
from shared.state.reader import StateReader

L4_PROTOCOL = "tcp"  # L4 and internal ports are "tcp" on the wire, even for UDP (proxies forward TCP only)


DEFAULT_HTTP_PORT = "http"


FALLBACK_HOST = "127.0.0.1"


_UNROUTABLE_NODE_STATUSES = frozenset({pb.NODE_STATUS_DOWN, pb.NODE_STATUS_DRAINED})


_RUN = pb.ASSIGNMENT_DESIRED_RUN


_HEALTHY = pb.INSTANCE_STATE_HEALTHY


_HTTP_PROTOCOLS = frozenset({pb.PROTOCOL_HTTP, pb.PROTOCOL_UNSPECIFIED})


_CANARY = pb.DEPLOYMENT_PHASE_CANARY


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


def canary_deployment(view: StateReader, env: pb.Environment) -> pb.Deployment | None:
    """The env's deployment in its CANARY phase beside the active release (issue 41), if any."""
    active = env.active_release_id
    for d in view.deployments(env.meta.id):
        if d.phase == _CANARY and d.previous_release_id == active and d.release_id != active:
            return d
    return None


@dataclass(frozen=True, slots=True)
class Weights:
    """A weighted route's releases: release id → share in basis points, and the step tag."""

    shares: Mapping[str, int]
    tag: str


def route_weights(view: StateReader, env: pb.Environment) -> Weights | None:
    """The env's traffic split while a canary runs (None: unweighted, the active release only)."""
    d = canary_deployment(view, env)
    if d is None:
        return None
    stable, canary = release_weights(d.canary.weight)
    return Weights({env.active_release_id: stable, d.release_id: canary}, step_tag(d.meta.id, d.canary.step))


def routable_replicas(
    view: StateReader, env: pb.Environment, hosts: NodeHosts, weights: Weights | None = None
) -> list[Replica]:
    """The env's assignments, by id, that may carry traffic: the active release only (and a canary's
    release with a weight above 0), desired RUN, observed HEALTHY exactly, on a routable node. A bound port
    depends on the port: see :class:`_Endpoints`."""
    active = env.active_release_id
    if not active:
        return []
    serving = {r for r, share in weights.shares.items() if share > 0} if weights is not None else {active}
    replicas = []
    for assignment in view.assignments(env.meta.id):
        if assignment.release_id in serving and assignment.desired == _RUN:
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


_ENDPOINT_RELEASE = tag(cpb.Endpoint.RELEASE_ID_FIELD_NUMBER, LEN)


_ENDPOINT_WEIGHT = tag(cpb.Endpoint.RELEASE_WEIGHT_FIELD_NUMBER, VARINT)


_ENDPOINT_STEP_TAG = tag(cpb.Endpoint.STEP_TAG_FIELD_NUMBER, LEN)


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

    def __init__(self, replicas: list[Replica], weights: Weights | None = None) -> None:
        self._replicas = replicas
        self._weights = weights
        self._sized: dict[str, list[bytes]] = {}
        self._release_fields: dict[str, bytes] = {}

    def _weighted_fields(self, weights: Weights, release_id: str) -> bytes:
        """The fields a weighted route adds to an endpoint of ``release_id``: its release, that release's share
        and the step tag, the same for every endpoint of the release (encoded once per release)."""
        fields = self._release_fields.get(release_id)
        if fields is None:
            fields = self._release_fields[release_id] = (
                string_field(_ENDPOINT_RELEASE, release_id)
                + uint_field(_ENDPOINT_WEIGHT, weights.shares.get(release_id, 0))
                + string_field(_ENDPOINT_STEP_TAG, weights.tag)
            )
        return fields

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
                    if self._weights is not None:
                        endpoint += self._weighted_fields(self._weights, assignment.release_id)
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
    weights = route_weights(view, env)
    endpoints = _Endpoints(routable_replicas(view, env, hosts, weights), weights)
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
