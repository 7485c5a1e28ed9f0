"""Route matching over one snapshot: the first step of the request pipeline, and the IP allowlist.

A :class:`RouteTable` is built once per accepted snapshot: routes grouped by lowercased hostname,
each group ordered by path-prefix length (longest first, snapshot order on ties), and what the pipeline's
steps read of each route (its IP allowlist parsed, its users, its limits, whether it is weighted) taken
out of the protobuf message once per snapshot, not per request.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.auth import route_users
from services.proxy.balancer import weighted

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """One route and what the request pipeline reads of it, taken out of the message once per snapshot."""

    route: cpb.HTTPRoute
    allowlist: tuple[IPNetwork, ...] | None
    """None = no allowlist; an empty tuple (every entry invalid) admits nobody."""
    env_id: str
    middleware: pb.Middleware | None
    """None = the route has no middleware."""
    users: dict[str, str]
    """username → bcrypt hash of every user the route lets in (:func:`route_users`; empty: no basic auth)."""
    rate_limit: tuple[int, int] | None
    """(requests per second, burst) of the per-client rate limit; None = no limit."""
    weighted: bool
    """A canary's route: its endpoints carry their release's share (:func:`weighted`)."""
    pinned: bool
    """A user stays on one endpoint (a cookie): sticky sessions, or a canary's route (a user stays on one
    release, issue 41)."""

    @classmethod
    def of(cls, route: cpb.HTTPRoute) -> RouteEntry:
        middleware = route.middleware if route.HasField("middleware") else None
        rate_limit: tuple[int, int] | None = None
        if route.HasField("rate_limit") and route.rate_limit.requests_per_second > 0:
            rps = route.rate_limit.requests_per_second
            rate_limit = (rps, route.rate_limit.burst or rps)
        canary = weighted(route.endpoints)
        return cls(
            route,
            parse_allowlist(list(middleware.ip_allowlist)) if middleware is not None else None,
            route.environment_id,
            middleware,
            route_users(middleware) if middleware is not None else {},
            rate_limit,
            canary,
            canary or (middleware is not None and middleware.sticky_sessions),
        )

    def admits(self, client_ip: str) -> bool:
        if self.allowlist is None:
            return True
        try:
            address = ipaddress.ip_address(client_ip)
        except ValueError:
            return False
        return any(address in network for network in self.allowlist)


def parse_allowlist(entries: list[str]) -> tuple[IPNetwork, ...] | None:
    """CIDRs or bare IPs (as /32 or /128); invalid entries are dropped (zattera.toml validation refuses them)."""
    if not entries:
        return None
    networks: list[IPNetwork] = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            continue
    return tuple(networks)


def request_host(host_header: str) -> str:
    """The Host header without its port, lowercased (``[::1]:8080`` → ``[::1]``)."""
    host = host_header.strip().lower()
    if host.endswith("]"):
        return host
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and "]" not in port:
        return name
    return host


class RouteTable:
    def __init__(self, snapshot: cpb.RouteSnapshot) -> None:
        self.version = snapshot.version
        self.cluster = snapshot.cluster
        self.env_ids = frozenset(route.environment_id for route in snapshot.http_routes)
        by_host: dict[str, list[RouteEntry]] = {}
        for route in snapshot.http_routes:
            by_host.setdefault(route.hostname.lower(), []).append(RouteEntry.of(route))
        for entries in by_host.values():
            entries.sort(key=lambda entry: -len(entry.route.path_prefix))  # stable: snapshot order on ties
        self._by_host = by_host
        self._snapshot = snapshot
        self._addrs: dict[str, frozenset[str]] | None = None

    def endpoint_addrs(self, env_id: str) -> frozenset[str]:
        """The addresses of the env's endpoints in this table (built on first use: only a proxy with
        requests in flight asks, once per heartbeat)."""
        if self._addrs is None:
            addrs: dict[str, set[str]] = {}
            for route in self._snapshot.http_routes:
                addrs.setdefault(route.environment_id, set()).update(e.addr for e in route.endpoints)
            self._addrs = {env: frozenset(found) for env, found in addrs.items()}
        return self._addrs.get(env_id, frozenset())

    def match(self, host: str, path: str) -> RouteEntry | None:
        """The route for a normalized host (see :func:`request_host`) and a URL path: raw string prefix,
        longest wins, no wildcard hosts."""
        for entry in self._by_host.get(host, ()):
            if path.startswith(entry.route.path_prefix):
                return entry
        return None
