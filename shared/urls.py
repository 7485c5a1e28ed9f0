"""The URLs an env answers on, as shown to operators (``zattera status``, the console): the ones that work.

A route's hostname alone is not a URL a browser can use: the proxies listen on ports of their own (8080 and
8443 for ``zattera up``), and HTTPS works only once the hostname has a certificate. So a URL carries the
port the proxies report in their heartbeats (``ProxyHeartbeat.http_port`` / ``https_port``; left out when it
is 80 / 443), and is ``https://`` when the hostname's certificate is usable (valid, or renewing while the
stored one has not expired) and the proxies serve HTTPS, ``http://`` otherwise. With no proxy reporting, the
ports are unknown and the URL has none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.clock import from_timestamp

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Listeners:
    """Where the proxies take requests (0 = unknown, or no such listener)."""

    http_port: int = 0
    https_port: int = 0


def proxy_listeners(proxies: Iterable[cpb.ProxyHeartbeat]) -> Listeners:
    """The ports most of the reporting proxies listen on (ties: the lower port)."""
    reports = list(proxies)

    def most_common(ports: list[int]) -> int:
        counted = Counter(port for port in ports if port)
        return min(counted, key=lambda port: (-counted[port], port)) if counted else 0

    return Listeners(most_common([p.http_port for p in reports]), most_common([p.https_port for p in reports]))


def usable_certificate(cert: pb.Certificate | None, now: float) -> bool:
    """Whether HTTPS to the certificate's hostname works now: a stored chain that has not expired (a renewing
    certificate is still served)."""
    if (
        cert is None
        or not cert.chain_pem
        or cert.state not in (pb.CERTIFICATE_STATE_VALID, pb.CERTIFICATE_STATE_RENEWING)
    ):
        return False
    return not cert.HasField("not_after") or from_timestamp(cert.not_after) > now


def url(hostname: str, path_prefix: str, listeners: Listeners, *, secure: bool) -> str:
    """``scheme://host[:port]/path``: HTTPS when ``secure`` and the proxies serve it, the port unless default."""
    scheme = "https" if secure and listeners.https_port else "http"
    port = listeners.https_port if scheme == "https" else listeners.http_port
    where = hostname if not port or port == DEFAULT_PORTS[scheme] else f"{hostname}:{port}"
    return f"{scheme}://{where}{path_prefix}"


def urls_by_env(
    routes: cpb.RouteSnapshot | None,
    listeners: Listeners,
    certificates: Mapping[str, pb.Certificate],
    now: float,
) -> dict[str, list[str]]:
    """Each env's URLs, sorted (module docstring); ``certificates``: hostname → its record."""
    found: dict[str, set[str]] = {}
    for route in routes.http_routes if routes else []:
        secure = usable_certificate(certificates.get(route.hostname), now)
        found.setdefault(route.environment_id, set()).add(
            url(route.hostname, route.path_prefix, listeners, secure=secure)
        )
    return {env_id: sorted(urls) for env_id, urls in found.items()}
