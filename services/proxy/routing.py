"""Route matching over one snapshot: the first step of the request pipeline, and the IP allowlist.

A :class:`RouteTable` is built once per accepted snapshot: routes grouped by lowercased hostname,
each group ordered by path-prefix length (longest first, snapshot order on ties), and each route's IP
allowlist parsed once per snapshot, not per request.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from zattera.cluster.v1 import cluster_pb2 as cpb

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class RouteEntry:
    route: cpb.HTTPRoute
    allowlist: tuple[IPNetwork, ...] | None
    """None = no allowlist; an empty tuple (every entry invalid) admits nobody."""

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
            allowlist = parse_allowlist(list(route.middleware.ip_allowlist)) if route.HasField("middleware") else None
            by_host.setdefault(route.hostname.lower(), []).append(RouteEntry(route, allowlist))
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
