"""The lines of a route's HAProxy backend besides its servers (pure): balance, retries and the queue, then
the middleware HAProxy applies itself, one function per stage of the Python pipeline.

Middleware, in the Python proxy's order (:data:`services.proxy.pipeline.ORDER`, which orders the frontend's and
each backend's rules too): IP allowlist (403) → HTTPS redirect (308) → rate limit (429) →
body cap (413, declared ``Content-Length``) → sticky cookie → ``balance random(2)`` (power of two
choices; the same-node tie-break is a weight of 101 against 100: HAProxy compares load per weight) with
``maxconn`` = ``max_concurrency`` and ``timeout queue`` = the hold timeout (a full env's requests queue
in HAProxy), ``retry-on conn-failure`` + ``option redispatch`` (a refused connection is retried on
another server). A ``scale_to_zero`` env's backend also has the Python handler as a ``backup`` server, and
its servers are marked down by the first refused connection (``observe layer4``, re-checked every
``HELD_CHECK_INTER``, :mod:`services.proxy.haproxy_config`): a request that meets a replica cooled a moment
ago, while the snapshot saying so is on its way, is redispatched to the handler, which holds it and wakes the
env, instead of a 503.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.balancer import STICKY_COOKIE
from services.proxy.pipeline import ORDER

HTTPS_VAR = "txn.https"
RATE_TABLE_SIZE = "32k"
RATE_TABLE_EXPIRE = "120s"


def json_return(status: int, message: str, *headers: str) -> str:
    """A rule answering the request itself with a JSON error."""
    extra = "".join(f" hdr {name} {value}" for name, value in (h.split(":", 1) for h in headers))
    return (
        f'http-request return status {status} content-type application/json string \'{{"error":"{message}"}}\'{extra}'
    )


def ms(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


def _allowlist(entries: Iterable[str]) -> list[str]:
    networks: list[str] = []
    for entry in entries:
        try:
            networks.append(str(ipaddress.ip_network(entry.strip(), strict=False)))
        except ValueError:
            continue  # invalid entries are dropped, as the Python proxy does
    return networks


def _allowlist_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not middleware.ip_allowlist:
        return []
    networks = _allowlist(middleware.ip_allowlist)
    condition = f" unless {{ src {' '.join(networks)} }}" if networks else ""
    return [json_return(403, "forbidden") + condition]


def _https_redirect_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not middleware.redirect_https:
        return []
    return [f"http-request redirect scheme https code 308 unless {{ var({HTTPS_VAR}) -m bool }}"]


def _rate_limit_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not (route.HasField("rate_limit") and route.rate_limit.requests_per_second > 0):
        return []
    allowed = max(route.rate_limit.burst, route.rate_limit.requests_per_second)
    return [
        f"stick-table type ipv6 size {RATE_TABLE_SIZE} expire {RATE_TABLE_EXPIRE} store http_req_rate(1s)",
        "http-request track-sc0 src",
        json_return(429, "rate limit exceeded", "Retry-After:1") + f" if {{ sc_http_req_rate(0) gt {allowed} }}",
    ]


def _body_cap_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not middleware.max_body_bytes:
        return []
    return [
        json_return(413, "request body too large")
        + f" if {{ req.hdr_val(content-length) gt {middleware.max_body_bytes} }}"
    ]


def is_weighted(route: cpb.HTTPRoute) -> bool:
    """A canary's route (issue 41): servers weighted by their release's share, users pinned by cookie."""
    return bool(route.endpoints) and bool(route.endpoints[0].step_tag)


def _endpoint_choice_rules(route: cpb.HTTPRoute, middleware: pb.Middleware) -> list[str]:
    if not (middleware.sticky_sessions or is_weighted(route)):
        return []  # ``balance random(2)`` and the queue are the backend's own lines
    return [f"cookie {STICKY_COOKIE} insert indirect nocache httponly attr SameSite=Lax"]


BACKEND_STAGES: dict[str, Callable[[cpb.HTTPRoute, pb.Middleware], list[str]]] = {
    "allowlist": _allowlist_rules,
    "https_redirect": _https_redirect_rules,
    "rate_limit": _rate_limit_rules,
    "body_cap": _body_cap_rules,
    "endpoint_choice": _endpoint_choice_rules,
}
"""The Python pipeline's middleware a backend applies itself, each one's rules (in :data:`ORDER`)."""
FRONTEND_STAGES = ("acme_challenge", "route_match")
"""Stages the frontend runs for every request, before any backend's (their rules: ``haproxy_config``)."""
ELSEWHERE = {
    "basic_auth": "a route with users is served by the Python handler (the hold backend)",
    "forward": "the backend's servers",
}
"""Stages with no rule of their own, and what does their work."""


def backend_rules(route: cpb.HTTPRoute, hold_timeout: float) -> tuple[str, ...]:
    """A backend's lines besides its servers: balance, retries and the queue, then its middleware in the
    Python pipeline's order, then compression (applied to the response)."""
    middleware = route.middleware if route.HasField("middleware") else pb.Middleware()
    rules = [
        # A canary's shares hold only when the draw follows the weights alone (P2C would favour the release
        # with fewer requests in flight: the canary).
        "balance random(1)" if is_weighted(route) else "balance random(2)",
        "option redispatch 1",
        "retries 3",
        # A scale-to-zero env's replica may die under a request (cooled while the snapshot saying so was on
        # its way): a GET or HEAD it closed without answering is sent again (to the hold backend, once the
        # dead server's refused connection has marked it down); nothing else is replayed.
        "retry-on conn-failure empty-response" if route.scale_to_zero else "retry-on conn-failure",
        *(["http-request disable-l7-retry unless METH_GET"] if route.scale_to_zero else []),
        f"timeout queue {ms(hold_timeout)}",
    ]
    for stage in ORDER:
        if stage in BACKEND_STAGES:
            rules += BACKEND_STAGES[stage](route, middleware)
    if middleware.compress:
        rules.append("compression algo gzip")
    return tuple(rules)
