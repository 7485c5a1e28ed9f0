"""Per-client rate limit: a route's ``rate_limit`` (requests per second, burst) per env and client IP;
beyond it, 429 with ``Retry-After``."""

from __future__ import annotations

from aiohttp import web

from services.proxy.pipeline.flow import Flow, Handler, error_response
from services.proxy.ratelimit import RateLimiter

RATE_LIMIT_RETRY_AFTER = "1"


class RateLimit:
    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    async def __call__(self, flow: Flow, following: Handler) -> web.StreamResponse:
        route = flow.route
        assert route is not None, "after the route match"
        if route.HasField("rate_limit") and route.rate_limit.requests_per_second > 0:
            rps = route.rate_limit.requests_per_second
            if not self.limiter.allow(f"{route.environment_id}|{flow.client_ip}", rps, route.rate_limit.burst or rps):
                return error_response(429, "rate limit exceeded", {"Retry-After": RATE_LIMIT_RETRY_AFTER})
        return await following(flow)
