"""Endpoint choice: the sticky endpoint a cookie names, else P2C under the route's concurrency cap. With
none to pick, a cold (``scale_to_zero``) or full route holds the request and asks for activation (503/504
when the hold gives up); any other route answers 502."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.activator import HoldRejected, Holds
from services.proxy.balancer import STICKY_COOKIE, Balancer, sticky_endpoint
from services.proxy.pipeline.flow import Flow, StepResult, error_response
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

    def __call__(self, flow: Flow) -> StepResult:
        entry = flow.entry
        assert entry is not None, "after the route match"
        route = entry.route
        endpoints = route.endpoints
        endpoint: cpb.Endpoint | None = None
        if entry.pinned:  # sticky sessions, or a canary's route: a user stays on one release (issue 41)
            cookie = flow.request.cookies.get(STICKY_COOKIE)
            endpoint = sticky_endpoint(endpoints, cookie) if cookie else None
            flow.pin_cookie = endpoint is None
        if endpoint is None and entry.weighted:
            endpoint = self.balancer.pick_weighted(endpoints, route.max_concurrency)
        elif endpoint is None:
            endpoint = self.balancer.pick(endpoints, route.max_concurrency)
        if endpoint is None:
            healthy = any(e.healthy for e in endpoints)
            cold = route.scale_to_zero and not healthy
            full = route.max_concurrency > 0 and healthy
            if not (cold or full):
                return error_response(502, "no healthy endpoint")
            return self._held(flow, entry.env_id)
        flow.endpoint = endpoint
        return None

    async def _held(self, flow: Flow, env_id: str) -> web.StreamResponse | None:
        """Hold the request until its route has an endpoint to take it (then it goes on), or answer it."""
        host, path = flow.host, flow.path
        try:
            choice = await self.holds.hold(
                env_id, flow.request.content_length, lambda: choose(self.table(), self.balancer, host, path)
            )
        except HoldRejected as exc:
            headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
            return error_response(exc.status, exc.message, headers)
        if choice.entry is None or choice.endpoint is None:
            return error_response(404, "no route for host")
        flow.entry, flow.endpoint = choice.entry, choice.endpoint
        return None
