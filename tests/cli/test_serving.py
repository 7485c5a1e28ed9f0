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
