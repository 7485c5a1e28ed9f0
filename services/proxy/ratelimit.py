"""Per-client token buckets: the rate-limit step of the request pipeline (429).

Keyed by ``environment_id|client_ip``; a new bucket starts full (``burst``), refills ``rps`` tokens per
second, a request costs one. At most :data:`MAX_BUCKETS` buckets: when full, buckets idle longer than
:data:`IDLE_AFTER` are swept, and if none is, the least recently used one is evicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_BUCKETS = 32_768
IDLE_AFTER = 120.0


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(
        self,
        *,
        max_buckets: int = MAX_BUCKETS,
        idle_after: float = IDLE_AFTER,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_buckets = max_buckets
        self.idle_after = idle_after
        self._monotonic = monotonic
        self._buckets: dict[str, _Bucket] = {}  # insertion order = least recently used first

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: str, rps: float, burst: float) -> bool:
        now = self._monotonic()
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            if len(self._buckets) >= self.max_buckets:
                self._make_room(now)
            bucket = _Bucket(tokens=burst, updated=now)
        else:
            bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rps)
            bucket.updated = now
        self._buckets[key] = bucket
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        return False

    def _make_room(self, now: float) -> None:
        idle = [key for key, bucket in self._buckets.items() if now - bucket.updated > self.idle_after]
        for key in idle:
            del self._buckets[key]
        if not idle:
            del self._buckets[next(iter(self._buckets))]
