"""Endpoint choice: the sticky endpoint a cookie names, else P2C under the route's concurrency cap. With
none to pick, a cold (``scale_to_zero``) or full route holds the request and asks for activation (503/504
when the hold gives up); any other route answers 502."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.activator import HoldRejected, Holds
from services.proxy.balancer import STICKY_COOKIE, Balancer, sticky_endpoint, weighted
from services.proxy.pipeline.flow import Flow, Handler, error_response
from services.proxy.routing import RouteEntry, RouteTable


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes; ``entry`` None = its route is gone (404)."""

    entry: RouteEntry | None
    endpoint: cpb.Endpoint | None = None


def choose(
    table: RouteTable, balancer: Balancer, host: str, path: str, refused: dict[str, int] | None = None
) -> Choice | None:
    """Re-match and re-pick for a held request: None = keep waiting. With ``refused`` (address → the table
    version under which it refused this request), only among the endpoints that have not refused it, or
    that a newer snapshot lists again."""
    entry = table.match(host, path)
    if entry is None:
        return Choice(None)
    endpoints: Sequence[cpb.Endpoint] = entry.route.endpoints
    if refused is not None:
        endpoints = [e for e in endpoints if table.version > refused.get(e.addr, -1)]
    endpoint = balancer.pick(endpoints, entry.route.max_concurrency)
    return Choice(entry, endpoint) if endpoint is not None else None


class EndpointChoice:
    def __init__(self, table: Callable[[], RouteTable], balancer: Balancer, holds: Holds) -> None:
        self.table = table
        self.balancer = balancer
        self.holds = holds

    async def __call__(self, flow: Flow, following: Handler) -> web.StreamResponse:
        route = flow.route
        assert route is not None, "after the route match"
        endpoint: cpb.Endpoint | None = None
        canary = weighted(route.endpoints)  # a user stays on one release (issue 41): pinned like a session
        if canary or (flow.middleware is not None and flow.middleware.sticky_sessions):
            cookie = flow.request.cookies.get(STICKY_COOKIE)
            endpoint = sticky_endpoint(route.endpoints, cookie) if cookie else None
            flow.pin_cookie = endpoint is None
        if endpoint is None and canary:
            endpoint = self.balancer.pick_weighted(route.endpoints, route.max_concurrency)
        elif endpoint is None:
            endpoint = self.balancer.pick(route.endpoints, route.max_concurrency)
        if endpoint is None:
            healthy = any(e.healthy for e in route.endpoints)
            cold = route.scale_to_zero and not healthy
            full = route.max_concurrency > 0 and healthy
            if not (cold or full):
                return error_response(502, "no healthy endpoint")
            host, path = flow.host, flow.path
            try:
                choice = await self.holds.hold(
                    route.environment_id,
                    flow.request.content_length,
                    lambda: choose(self.table(), self.balancer, host, path),
                )
            except HoldRejected as exc:
                headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
                return error_response(exc.status, exc.message, headers)
            if choice.entry is None or choice.endpoint is None:
                return error_response(404, "no route for host")
            flow.route, endpoint = choice.entry.route, choice.endpoint
        flow.endpoint = endpoint
        return await following(flow)
