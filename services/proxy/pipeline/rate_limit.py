"""Per-client rate limit: a route's ``rate_limit`` (requests per second, burst) per env and client IP;
beyond it, 429 with ``Retry-After``."""

from __future__ import annotations

from services.proxy.pipeline.flow import Flow, StepResult, client_ip, error_response
from services.proxy.ratelimit import RateLimiter

RATE_LIMIT_RETRY_AFTER = "1"


class RateLimit:
    def __init__(self, limiter: RateLimiter, behind_engine: bool) -> None:
        self.limiter = limiter
        self.behind_engine = behind_engine

    def __call__(self, flow: Flow) -> StepResult:
        entry = flow.entry
        assert entry is not None, "after the route match"
        if entry.rate_limit is not None:
            rps, burst = entry.rate_limit
            key = f"{entry.env_id}|{client_ip(flow.request, self.behind_engine)}"
            if not self.limiter.allow(key, rps, burst):
                return error_response(429, "rate limit exceeded", {"Retry-After": RATE_LIMIT_RETRY_AFTER})
        return None
