"""Route match: the route of the request's host and path in the current route table, or 404."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from services.proxy.pipeline.flow import ENV_KEY, Flow, Handler, error_response
from services.proxy.routing import RouteTable


class RouteMatch:
    def __init__(self, table: Callable[[], RouteTable]) -> None:
        self.table = table
        """The current table (replaced on every accepted snapshot)."""

    async def __call__(self, flow: Flow, following: Handler) -> web.StreamResponse:
        entry = self.table().match(flow.host, flow.path)
        if entry is None:
            return error_response(404, "no route for host")
        flow.entry, flow.route = entry, entry.route
        flow.middleware = entry.route.middleware if entry.route.HasField("middleware") else None
        flow.request[ENV_KEY] = entry.route.environment_id
        return await following(flow)
