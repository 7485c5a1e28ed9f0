"""RouteBuilder: the spec's C1 cases and the construction rules of A1, as fast table tests.

Every case goes through :class:`Routes`, which updates the builder incrementally from the view's change
feed and checks, on every read, that the result is byte for byte a full rebuild's and the canonical
protobuf encoding of the snapshot.
"""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.builder import RELEVANT_KINDS, RouteBuilder
from services.routes.env_routes import encode_snapshot, http_port_name
from shared import keys as K
from tests.memory_state import MemoryState
from tests.routes import state as S
from tests.routes.state import DOMAIN, Write, write_local


class Routes:
    def __init__(self, *writes: Write | list[Write], domain: str = DOMAIN) -> None:
        self.state = MemoryState()
        self.domain = domain
        self.builder = RouteBuilder(self.state.store, domain=domain)
        self.feed = self.state.store.subscribe(RELEVANT_KINDS)
        write_local(self.state, *writes)
        self.builder.rebuild_all()
        self.feed.drain()

    def write(self, *writes: Write | list[Write]) -> set[str]:
        write_local(self.state, *writes)
        return self.builder.apply_changes(self.feed.drain())

    def snapshot(self) -> cpb.RouteSnapshot:
        full = RouteBuilder(self.state.store, domain=self.domain)
        full.rebuild_all()
        assert self.builder.content() == full.content(), "incremental build differs from a full build"
        snapshot = self.builder.snapshot()
        assert encode_snapshot(snapshot.version, self.builder.content()) == snapshot.SerializeToString(
            deterministic=True
        )
        return snapshot

    def route(self, hostname: str) -> cpb.HTTPRoute:
        matches = [r for r in self.snapshot().http_routes if r.hostname == hostname]
        assert len(matches) == 1, f"{len(matches)} routes for {hostname}"
        return matches[0]

    def addrs(self, hostname: str = "api-production.apps.example.com") -> list[str]:
        return [e.addr for e in self.route(hostname).endpoints]


IMPLICIT = "api-production.apps.example.com"


# ---------------------------------------------------------------------------------------------- C1


def test_build_routes_custom_domain_and_implicit_subdomain() -> None:
    routes = Routes(*S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001), S.domain())
    snapshot = routes.snapshot()
    assert snapshot.version != 0
    custom = routes.route("api.example.com")
    assert routes.route(IMPLICIT)
    assert [e.addr for e in custom.endpoints] == ["10.90.0.1:30001"]
    assert custom.route_generation == 1
    assert len(snapshot.cert_hosts) == 2


def test_rate_limit_is_carried_by_both_route_kinds() -> None:
    routes = Routes(*S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001), S.domain())
    routes.write(S.env(rate_limit=pb.RateLimit(requests_per_second=25, burst=50)))
    for hostname in ("api.example.com", IMPLICIT):
        limit = routes.route(hostname).rate_limit
        assert (limit.requests_per_second, limit.burst) == (25, 50)


def test_promotion_swaps_endpoints_in_one_snapshot() -> None:
    routes = Routes(
        *S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001), S.healthy_assignment("a2", "relB", 30002)
    )
    assert routes.addrs() == ["10.90.0.1:30001"]
    routes.write(S.env(active_release_id="relB", route_generation=2))
    assert routes.addrs() == ["10.90.0.1:30002"]
    assert routes.route(IMPLICIT).route_generation == 2


def test_only_healthy_replicas_are_endpoints() -> None:
    routes = Routes(
        *S.seed_route_env(),
        S.healthy_assignment("a1", "relA", 30001),
        S.assignment("a2", "relA", {"http": 30002}, state=pb.INSTANCE_STATE_RUNNING),
    )
    assert routes.addrs() == ["10.90.0.1:30001"]


def test_node_down_drops_its_endpoints_but_keeps_the_route() -> None:
    routes = Routes(*S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001))
    routes.write(S.node(status=pb.NODE_STATUS_DOWN))
    assert routes.addrs() == []


def test_l4_route_and_internal_service() -> None:
    db = pb.PortSpec(name="db", container_port=5432, protocol=pb.PROTOCOL_TCP, public_l4_port=15432)
    routes = Routes(
        *S.seed_route_env(),
        S.env(ports=[S.http_port(), db]),
        S.assignment("a1", "relA", {"http": 30001, "db": 30005}),
        S.vip(address="127.128.0.5"),
    )
    snapshot = routes.snapshot()
    assert len(snapshot.l4_routes) == 1
    l4 = snapshot.l4_routes[0]
    assert (l4.public_port, l4.protocol, [e.addr for e in l4.endpoints]) == (15432, "tcp", ["10.90.0.1:30005"])
    assert len(snapshot.internal_services) == 1
    service = snapshot.internal_services[0]
    assert (service.vip, service.fqdn) == ("127.128.0.5", "api.production.demo.internal.")
    assert [(p.name, p.port, p.protocol) for p in service.ports] == [("http", 8080, "tcp"), ("db", 5432, "tcp")]


def test_a_tcp_only_env_gets_its_l4_route_and_internal_service_but_no_http_route_nor_certificate() -> None:
    db = pb.PortSpec(name="db", container_port=5432, protocol=pb.PROTOCOL_TCP, public_l4_port=15432)
    routes = Routes(
        *S.seed_route_env(),
        S.env(ports=[db]),
        S.domain(hostname="db.example.com"),  # a domain attached to it all the same
        S.assignment("a1", "relA", {"db": 30005}),
        S.vip(address="127.128.0.5"),
    )
    snapshot = routes.snapshot()
    assert (list(snapshot.http_routes), list(snapshot.cert_hosts)) == ([], [])
    assert [e.addr for e in snapshot.l4_routes[0].endpoints] == ["10.90.0.1:30005"]
    assert [p.name for p in snapshot.internal_services[0].ports] == ["db"]
    # Adding an HTTP port gives it its HTTP routes; a domain naming the TCP port still gets none.
    web = pb.PortSpec(name="web", container_port=8080, protocol=pb.PROTOCOL_HTTP)
    routes.write(S.env(ports=[db, web]), S.domain("dom2", "raw.example.com", port_name="db"))
    assert sorted(r.hostname for r in routes.snapshot().http_routes) == [
        "api-production.apps.example.com",
        "db.example.com",
    ]


# ---------------------------------------------------------------------------------------------- A1 rules


@pytest.mark.parametrize(
    ("ports", "expected"),
    [
        ([], "http"),
        ([("web", pb.PROTOCOL_HTTP)], "web"),
        ([("db", pb.PROTOCOL_TCP), ("web", pb.PROTOCOL_UNSPECIFIED)], "web"),
        ([("db", pb.PROTOCOL_TCP), ("web", pb.PROTOCOL_HTTP), ("admin", pb.PROTOCOL_HTTP)], "web"),
        ([("dns", pb.PROTOCOL_UDP), ("db", pb.PROTOCOL_TCP)], ""),
    ],
    ids=["no-ports-means-http", "http-port", "unspecified-counts-as-http", "first-http-wins", "tcp-only-means-none"],
)
def test_http_port_selection(ports: list[tuple[str, int]], expected: str) -> None:
    spec = pb.ServiceSpec(ports=[pb.PortSpec(name=n, protocol=p) for n, p in ports])  # type: ignore[arg-type]
    assert http_port_name(spec) == expected


@pytest.mark.parametrize(
    ("writes", "routed"),
    [
        ([S.healthy_assignment("a1", "relA", 30001)], True),
        ([S.healthy_assignment("a1", "relB", 30001)], False),
        ([S.healthy_assignment("a1", "relA", 30001, desired=pb.ASSIGNMENT_DESIRED_STOP)], False),
        ([S.assignment("a1", "relA", {"http": 30001}, state=pb.INSTANCE_STATE_STARTING)], False),
        ([S.assignment("a1", "relA", {"http": 30001}, state=pb.INSTANCE_STATE_UNHEALTHY)], False),
        ([S.assignment("a1", "relA", {"db": 30001})], False),
        ([S.assignment("a1", "relA", {"http": 0})], False),
        ([S.healthy_assignment("a1", "relA", 30001), S.node(status=pb.NODE_STATUS_SUSPECT)], True),
        ([S.healthy_assignment("a1", "relA", 30001), S.node(status=pb.NODE_STATUS_DRAINING)], True),
        ([S.healthy_assignment("a1", "relA", 30001), S.node(status=pb.NODE_STATUS_DRAINED)], False),
        ([S.healthy_assignment("a1", "relA", 30001, node_id="ghost")], False),
        ([S.env(active_release_id=""), S.healthy_assignment("a1", "relA", 30001)], False),
    ],
    ids=[
        "healthy-active-run-bound-is-routed",
        "other-release-is-not",
        "desired-stop-is-not",
        "starting-is-not",
        "unhealthy-is-not",
        "port-not-bound-is-not",
        "port-bound-to-zero-is-not",
        "suspect-node-keeps-it",
        "draining-node-keeps-it",
        "drained-node-drops-it",
        "missing-node-drops-it",
        "no-active-release-no-endpoints",
    ],
)
def test_endpoint_selection(writes: list[Write | list[Write]], routed: bool) -> None:
    routes = Routes(*S.seed_route_env(), *writes)
    assert routes.addrs() == (["10.90.0.1:30001"] if routed else [])


def test_endpoint_addr_falls_back_to_loopback_and_to_the_desired_binding() -> None:
    desired_binding = S.assignment("a2", "relA")
    desired_binding[0][1].mesh_port_bindings["http"] = 30002  # type: ignore[union-attr]
    routes = Routes(*S.seed_route_env(), S.node(mesh_ip=""), S.healthy_assignment("a1", "relA", 30001), desired_binding)
    endpoint = routes.route(IMPLICIT).endpoints[0]
    assert routes.addrs() == ["127.0.0.1:30001", "127.0.0.1:30002"]
    assert (endpoint.assignment_id, endpoint.node_id, endpoint.healthy, endpoint.local_hint_node_id_matches) == (
        "a1",
        "n1",
        True,
        False,
    )


def test_endpoints_sorted_by_assignment_id() -> None:
    routes = Routes(
        *S.seed_route_env(),
        S.healthy_assignment("a3", "relA", 30003),
        S.healthy_assignment("a1", "relA", 30001),
        S.healthy_assignment("a2", "relA", 30002),
    )
    assert routes.addrs() == ["10.90.0.1:30001", "10.90.0.1:30002", "10.90.0.1:30003"]


def test_domain_fields_middleware_port_override_and_ordering() -> None:
    admin = pb.PortSpec(name="admin", container_port=9000, protocol=pb.PROTOCOL_HTTP)
    middleware = pb.Middleware(redirect_https=True, sticky_sessions=True)
    routes = Routes(
        *S.seed_route_env(),
        S.env(ports=[S.http_port(), admin], scale_to_zero=True, max_concurrency=4),
        S.assignment("a1", "relA", {"http": 30001, "admin": 30009}),
        S.domain("dom2", "Admin.Example.com", path_prefix="/admin", port_name="admin", middleware=middleware),
        S.domain("dom1", "api.example.com"),
        S.domain("dom3", "other.example.com", project_id="elsewhere"),
    )
    snapshot = routes.snapshot()
    assert [r.hostname for r in snapshot.http_routes] == ["api.example.com", "Admin.Example.com", IMPLICIT]
    custom, admin_route, implicit = snapshot.http_routes
    assert not custom.HasField("middleware")
    assert admin_route.middleware == middleware
    assert (admin_route.path_prefix, [e.addr for e in admin_route.endpoints]) == ("/admin", ["10.90.0.1:30009"])
    assert not implicit.HasField("middleware")
    assert [e.addr for e in implicit.endpoints] == ["10.90.0.1:30001"]
    for route in snapshot.http_routes:
        assert (route.scale_to_zero, route.max_concurrency, route.app_name, route.environment_name) == (
            True,
            4,
            "api",
            "production",
        )
        assert not route.HasField("rate_limit")
    assert list(snapshot.cert_hosts) == ["Admin.Example.com", "api-production.apps.example.com", "api.example.com"]


def test_env_middleware_covers_its_domains_and_implicit_host_unless_a_domain_has_its_own() -> None:
    env_key, env = S.env()
    assert isinstance(env, pb.Environment)
    env.middleware.ip_allowlist.append("10.0.0.0/8")
    env.middleware.basic_auth_users.add(username="ops", password_hash="$2b$04$" + "a" * 53)
    own = pb.Middleware(sticky_sessions=True)
    routes = Routes(
        *S.seed_route_env(),
        (env_key, env),
        S.domain("dom1", "api.example.com"),
        S.domain("dom2", "own.example.com", middleware=own),
    )
    assert routes.route("api.example.com").middleware == env.middleware
    assert routes.route(IMPLICIT).middleware == env.middleware  # no way around it through the implicit host
    assert routes.route("own.example.com").middleware == own
    cleared = pb.Environment()
    cleared.CopyFrom(env)
    cleared.ClearField("middleware")
    routes.write((env_key, cleared))
    assert not routes.route(IMPLICIT).HasField("middleware")


def test_no_cluster_domain_means_no_implicit_route() -> None:
    routes = Routes(*S.seed_route_env(), S.domain(), domain="")
    assert [r.hostname for r in routes.snapshot().http_routes] == ["api.example.com"]


def test_env_without_app_vanishes_from_every_section() -> None:
    routes = Routes(*S.seed_route_env(), S.vip(), S.domain(), (K.app("app"), None))
    snapshot = routes.snapshot()
    assert (len(snapshot.http_routes), len(snapshot.internal_services), len(snapshot.cert_hosts)) == (0, 0, 0)
    routes.write(S.app())
    assert len(routes.snapshot().internal_services) == 1


def test_internal_fqdn_uses_project_id_when_project_missing_and_lists_ports_even_empty() -> None:
    routes = Routes(S.app(), S.env(ports=[]), S.vip(), S.env("env2", ports=[S.http_port()]))
    snapshot = routes.snapshot()
    assert [s.fqdn for s in snapshot.internal_services] == ["api.production.proj.internal."]
    assert len(snapshot.internal_services[0].ports) == 0


def test_sections_are_ordered_by_env_id_and_hosts_deduplicated() -> None:
    routes = Routes(
        S.project(),
        S.app(),
        S.node(),
        S.env("env2", name="staging"),
        S.env("env1"),
        S.domain("dom1", "shared.example.com", env_id="env2"),
        S.domain("dom2", "shared.example.com", env_id="env1"),
    )
    snapshot = routes.snapshot()
    assert [(r.environment_id, r.hostname) for r in snapshot.http_routes] == [
        ("env1", "shared.example.com"),
        ("env1", IMPLICIT),
        ("env2", "shared.example.com"),
        ("env2", "api-staging.apps.example.com"),
    ]
    assert list(snapshot.cert_hosts) == [IMPLICIT, "api-staging.apps.example.com", "shared.example.com"]


# ---------------------------------------------------------------------------------------------- incremental


@pytest.mark.parametrize(
    ("change", "affected"),
    [
        (S.env("env2", name="qa"), {"env2"}),
        (S.app(name="web"), {"env1", "env2"}),
        (S.project(name="renamed"), {"env1", "env2"}),
        (S.domain("dom1", "moved.example.com", env_id="env2"), {"env1", "env2"}),
        ((K.domain("dom1"), None), {"env1"}),
        (S.healthy_assignment("a1", "relA", 31001), {"env1"}),
        (S.node("n2", status=pb.NODE_STATUS_DOWN), {"env2"}),
        (S.node("n3"), set()),
        (S.vip("env2", "127.128.0.9"), {"env2"}),
    ],
    ids=[
        "env-change-rebuilds-that-env",
        "app-change-rebuilds-its-envs",
        "project-change-rebuilds-its-envs",
        "moved-domain-rebuilds-old-and-new-env",
        "deleted-domain-rebuilds-its-env",
        "observed-change-rebuilds-its-env",
        "node-status-rebuilds-envs-with-replicas-on-it",
        "node-without-replicas-rebuilds-nothing",
        "vip-change-rebuilds-its-env",
    ],
)
def test_a_change_rebuilds_only_the_envs_it_affects(change: Write | list[Write], affected: set[str]) -> None:
    routes = Routes(
        *S.seed_route_env(),
        S.node("n2", mesh_ip="10.90.0.2"),
        S.env("env2", name="staging"),
        S.env("env3", app_id="other-app", project_id="other-project", name="lonely"),
        S.healthy_assignment("a1", "relA", 30001),
        S.healthy_assignment("a2", "relA", 30002, env_id="env2", node_id="n2"),
        S.domain(),
    )
    assert routes.write(change) == affected
    routes.snapshot()


def test_unrelated_writes_do_not_move_the_revision() -> None:
    routes = Routes(*S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001))
    before = routes.builder.revision
    routes.write((K.lease("scheduler"), pb.Lease(holder="x", term=1)))
    routes.write((K.release("relA"), pb.Release(environment_id="env1")))
    assert routes.builder.revision == before
    routes.write((K.domain("gone"), None))
    assert routes.builder.revision == routes.state.revision
