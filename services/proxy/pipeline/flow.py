"""What the middlewares of the request pipeline share: the :class:`Flow` of one request (what earlier steps
found out about it), the handler and middleware types, :func:`chain` that composes them, and the one JSON
error answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.routing import RouteEntry

ENV_KEY = web.RequestKey("zattera.env", str)
"""Where the route match leaves the matched env id on the request, for the metrics."""


@dataclass(slots=True)
class Flow:
    """One request on its way through the pipeline; each step fills in what it decided."""

    request: web.BaseRequest
    host: str
    path: str
    entry: RouteEntry | None = None
    route: cpb.HTTPRoute | None = None
    middleware: pb.Middleware | None = None
    client_ip: str = ""
    body_cap: int = 0
    endpoint: cpb.Endpoint | None = None
    pin_cookie: bool = False


Handler = Callable[[Flow], Awaitable[web.StreamResponse]]
Middleware = Callable[[Flow, Handler], Awaitable[web.StreamResponse]]


def chain(middlewares: Sequence[Middleware], last: Handler) -> Handler:
    """One handler running ``middlewares`` in order, each given the rest of the chain, ``last`` at the end."""
    handler = last
    for middleware in reversed(middlewares):
        handler = _bound(middleware, handler)
    return handler


def _bound(middleware: Middleware, following: Handler) -> Handler:
    async def handle(flow: Flow) -> web.StreamResponse:
        return await middleware(flow, following)

    return handle


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """Every error the proxy answers itself: ``{"error": "<msg>"}`` as JSON."""
    return web.json_response({"error": message}, status=status, headers=headers)
