"""Body cap: a declared body above the route's ``max_body_bytes`` is refused up front with 413; an
undeclared (chunked) one is cut at the cap while it is forwarded (the upstream request then fails: 502)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from services.proxy.pipeline.flow import Flow, StepResult, error_response


def body_cap(flow: Flow) -> StepResult:
    assert flow.entry is not None, "after the route match"
    middleware = flow.entry.middleware
    flow.body_cap = middleware.max_body_bytes if middleware is not None else 0
    if flow.body_cap:
        length = flow.request.content_length
        if length is not None and length > flow.body_cap:
            return error_response(413, "request body too large")
    return None


async def capped(body: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The request body, failing once it exceeds ``limit`` bytes (the upstream request then fails: 502)."""
    seen = 0
    async for chunk in body.iter_any():
        seen += len(chunk)
        if seen > limit:
            raise ValueError(f"request body exceeds {limit} bytes")
        yield chunk
