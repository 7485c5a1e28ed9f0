"""What the steps of the request pipeline share: the :class:`Flow` of one request (what earlier steps
found out about it), the step and handler types, :func:`chain` that composes them into the request handler,
and the one JSON error answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import hdrs, web
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.routing import RouteEntry, request_host

ENV_KEY = web.RequestKey("zattera.env", str)
"""Where the route match leaves the matched env id on the request, for the metrics."""


@dataclass(slots=True)
class Flow:
    """One request on its way through the pipeline; each step fills in what it decided."""

    request: web.BaseRequest
    host: str
    path: str
    entry: RouteEntry | None = None
    """The matched route (a held request's may be another one than first matched)."""
    body_cap: int = 0
    endpoint: cpb.Endpoint | None = None
    pin_cookie: bool = False


Handler = Callable[[Flow], Awaitable[web.StreamResponse]]
StepResult = web.StreamResponse | Awaitable[web.StreamResponse | None] | None
"""What a step returns: None lets the request through to the next step, a response answers it; a step that
must wait first (an ACME answer looked up, a password checked, a held request) returns an awaitable of
either."""
Step = Callable[[Flow], StepResult]


def chain(steps: Sequence[Step], last: Handler) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The request handler: the request's :class:`Flow` through ``steps`` in order until one answers,
    ``last`` when none does. The steps are plain calls, not a nest of coroutines: a request that waits
    upstream is resumed through this handler and ``last`` only, whatever the number of steps."""
    ordered = tuple(steps)

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        flow = Flow(request, request_host(request.headers.get(hdrs.HOST, "")), request.path)
        for step in ordered:
            result = step(flow)
            if result is None:
                continue
            if not isinstance(result, web.StreamResponse):
                result = await result
                if result is None:
                    continue
            return result
        return await last(flow)

    return handle


def client_ip(request: web.BaseRequest, behind_engine: bool) -> str:
    """The client: the connection's peer, or the last ``X-Forwarded-For`` value behind an engine in front
    (HAProxy). Read by the steps that need it (allowlist, rate limit), only for a route that has them."""
    if behind_engine:
        forwarded = request.headers.getall("X-Forwarded-For", ())
        if forwarded:
            return forwarded[-1].rsplit(",", 1)[-1].strip()
    return request.remote or ""


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """Every error the proxy answers itself: ``{"error": "<msg>"}`` as JSON."""
    return web.json_response({"error": message}, status=status, headers=headers)
