"""The URLs shown to operators are the ones that work: the proxies' ports, HTTPS once a certificate is usable."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.clock import to_timestamp
from shared.urls import Listeners, proxy_listeners, urls_by_env

NOW = 1_800_000_000.0


def cert(state: int, *, expires: float = NOW + 86400, chain: str = "PEM") -> pb.Certificate:
    return pb.Certificate(hostname="shop.example.com", state=state, chain_pem=chain, not_after=to_timestamp(expires))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("listeners", "certificate", "expected"),
    [
        (Listeners(8080, 8443), None, "http://shop.example.com:8080/api"),
        (Listeners(8080, 8443), cert(pb.CERTIFICATE_STATE_VALID), "https://shop.example.com:8443/api"),
        (Listeners(8080, 8443), cert(pb.CERTIFICATE_STATE_RENEWING), "https://shop.example.com:8443/api"),
        (Listeners(8080, 8443), cert(pb.CERTIFICATE_STATE_VALID, expires=NOW - 1), "http://shop.example.com:8080/api"),
        (Listeners(8080, 8443), cert(pb.CERTIFICATE_STATE_PENDING, chain=""), "http://shop.example.com:8080/api"),
        (Listeners(8080, 8443), cert(pb.CERTIFICATE_STATE_FAILED, chain=""), "http://shop.example.com:8080/api"),
        (Listeners(8080, 0), cert(pb.CERTIFICATE_STATE_VALID), "http://shop.example.com:8080/api"),  # no HTTPS listener
        (Listeners(80, 443), None, "http://shop.example.com/api"),
        (Listeners(80, 443), cert(pb.CERTIFICATE_STATE_VALID), "https://shop.example.com/api"),
        (Listeners(), None, "http://shop.example.com/api"),  # no proxy reporting: the port is unknown
    ],
)
def test_a_route_url_carries_the_port_and_scheme_that_work(
    listeners: Listeners, certificate: pb.Certificate | None, expected: str
) -> None:
    routes = cpb.RouteSnapshot(version=1)
    routes.http_routes.add(hostname="shop.example.com", path_prefix="/api", environment_id="e1")
    certificates = {"shop.example.com": certificate} if certificate is not None else {}
    assert urls_by_env(routes, listeners, certificates, NOW) == {"e1": [expected]}


def test_the_ports_are_those_most_proxies_report() -> None:
    reports = [
        cpb.ProxyHeartbeat(proxy_id="a", http_port=8080, https_port=8443),
        cpb.ProxyHeartbeat(proxy_id="b", http_port=8080, https_port=8443),
        cpb.ProxyHeartbeat(proxy_id="c", http_port=80, https_port=0),
        cpb.ProxyHeartbeat(proxy_id="old"),  # a proxy that predates the fields
    ]
    assert proxy_listeners(reports) == Listeners(8080, 8443)
    assert proxy_listeners([]) == Listeners()
