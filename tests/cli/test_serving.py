"""``zattera deploy`` says "live" only once the proxies route to the new release: the decision table."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.watch import serving

GEN = 5


def env(*, generation: int = GEN, cold: bool = False) -> pb.Environment:
    e = pb.Environment(active_release_id="rel2", route_generation=generation, effective_replicas=0 if cold else 2)
    e.meta.id = "env1"
    e.service.scale_to_zero = cold
    return e


def snapshot(version: int, *, generation: int = GEN, endpoints: int = 1, env_id: str = "env1") -> cpb.RouteSnapshot:
    route = cpb.HTTPRoute(hostname="hello.localhost", environment_id=env_id, route_generation=generation)
    route.endpoints.extend(cpb.Endpoint(assignment_id=f"a{i}", addr=f"127.0.0.1:{9000 + i}") for i in range(endpoints))
    return cpb.RouteSnapshot(version=version, http_routes=[route])


def proxy(proxy_id: str, version: int) -> cpb.ProxyHeartbeat:
    return cpb.ProxyHeartbeat(proxy_id=proxy_id, routes_version=version)


@pytest.mark.parametrize(
    ("case", "found", "live", "detail", "version"),
    [
        ((env(), None, []), 0, False, "the first route snapshot", 0),
        ((env(), snapshot(40, generation=GEN - 1), []), 0, False, "switch hello.localhost to the new release", 0),
        ((env(), snapshot(40, endpoints=0), []), 0, False, "a healthy replica of the release", 0),
        ((env(), snapshot(41), [proxy("p1", 40), proxy("p2", 41)]), 0, False, "proxies p1 (at 40) to load", 41),
        ((env(), snapshot(45), [proxy("p1", 40)]), 41, False, "route version 41", 41),
        ((env(), snapshot(41), [proxy("p1", 41), proxy("p2", 44)]), 0, True, "served by 2 proxy(ies)", 41),
        ((env(), snapshot(41), []), 0, True, "no proxy is reporting", 41),
        ((env(cold=True), snapshot(41, endpoints=0), [proxy("p1", 41)]), 0, True, "served by 1", 41),
        ((env(), snapshot(41, env_id="other"), [proxy("p1", 1)]), 0, True, "no HTTP route", 0),
    ],
)
def test_live_only_once_every_reporting_proxy_holds_the_routes_of_the_release(case, found, live, detail, version):
    state = serving(*case, found)
    assert (state.live, state.routes_version) == (live, version)
    assert detail in state.detail


THIS = cpb.ClusterIdentity(id="01SECURE", epoch="2025-02-01T00:00:00+00:00")
EARLIER = cpb.ClusterIdentity(id="01OPEN", epoch="2025-01-01T00:00:00+00:00")


def named(snap: cpb.RouteSnapshot, cluster: cpb.ClusterIdentity) -> cpb.RouteSnapshot:
    snap.cluster.CopyFrom(cluster)
    return snap


def proxy_of(proxy_id: str, version: int, cluster: cpb.ClusterIdentity) -> cpb.ProxyHeartbeat:
    beat = proxy(proxy_id, version)
    beat.routes_cluster.CopyFrom(cluster)
    return beat


@pytest.mark.parametrize(
    ("proxies", "live", "detail"),
    [
        # The case: the proxy kept an earlier cluster's routes at a higher version (7725 > 868).
        ([proxy_of("local", 7725, EARLIER)], False, "local (serving cluster 01OPEN"),
        ([proxy_of("p1", 868, THIS), proxy_of("p2", 7725, EARLIER)], False, "p2 (serving cluster 01OPEN"),
        ([proxy_of("local", 868, THIS)], True, "served by 1 proxy(ies) at route version 868"),
        ([proxy("old", 868)], True, "served by 1"),  # a proxy that names no cluster: its version alone
    ],
)
def test_a_proxy_serving_another_clusters_routes_is_never_counted_live_whatever_its_version(
    proxies: list[cpb.ProxyHeartbeat], live: bool, detail: str
) -> None:
    state = serving(env(), named(snapshot(868), THIS), proxies, 0)
    assert state.live is live
    assert detail in state.detail
