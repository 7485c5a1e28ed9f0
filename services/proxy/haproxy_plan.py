"""How a route snapshot becomes the :class:`~services.proxy.haproxy_config.Plan` HAProxy serves (pure).

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

Routes that HAProxy does not serve itself go to the ``hold`` backend, whose one server is the Python
handler (:class:`services.proxy.server.Proxy` on loopback): routes with no healthy endpoint (cold:
hold-and-activate, or the 502 "no healthy endpoint") and routes with basic auth (HAProxy 2.6 checks
bcrypt hashes with crypt(3) on its single event loop, without caching: ~0.1 s of a stalled data plane
per request; the Python handler checks in a thread and remembers logins).

The configuration text of a plan is rendered by :mod:`services.proxy.haproxy_config`; each backend's rules
come from :mod:`services.proxy.haproxy_rules`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.auth import route_users
from services.proxy.balancer import sticky_value
from services.proxy.haproxy_config import HOLD_BACKEND, Backend, Plan, Server
from services.proxy.haproxy_rules import backend_rules, is_weighted

LOCAL_WEIGHT = 101
REMOTE_WEIGHT = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


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
