"""Endpoint choice: sticky cookie, then power-of-two-choices on this proxy's in-flight count per endpoint
address, skipping endpoints at ``max_concurrency``. A counter is removed when it drops to zero, so
endpoint churn does not grow the map forever.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence

from zattera.cluster.v1 import cluster_pb2 as cpb

STICKY_COOKIE = "zt_sticky"
_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def sticky_value(endpoint: cpb.Endpoint) -> str:
    """Base-36 of the 32-bit FNV-1a of the endpoint's assignment id (its addr when the id is empty)."""
    value = _FNV32_OFFSET
    for byte in (endpoint.assignment_id or endpoint.addr).encode():
        value = ((value ^ byte) * _FNV32_PRIME) & 0xFFFFFFFF
    digits = ""
    while True:
        value, digit = divmod(value, 36)
        digits = _BASE36[digit] + digits
        if value == 0:
            return digits


def weighted(endpoints: Sequence[cpb.Endpoint]) -> bool:
    """A canary's route: its endpoints carry their release's share (issue 41)."""
    return bool(endpoints) and bool(endpoints[0].step_tag)


def sticky_endpoint(endpoints: Sequence[cpb.Endpoint], cookie: str) -> cpb.Endpoint | None:
    """The healthy endpoint a sticky cookie pins (the cap is bypassed: the session stays where it is)."""
    for endpoint in endpoints:
        if endpoint.healthy and sticky_value(endpoint) == cookie:
            return endpoint
    return None


class Balancer:
    def __init__(self, node_id: str = "", rng: random.Random | None = None) -> None:
        self.node_id = node_id
        self._rng = rng or random.Random()
        self._inflight: dict[str, int] = {}
        self._env_of: dict[str, str] = {}
        """Address with requests in flight → the env they were sent for (``""``: not told)."""

    def inflight(self, addr: str) -> int:
        return self._inflight.get(addr, 0)

    def acquire(self, addr: str, env_id: str = "") -> None:
        self._inflight[addr] = self._inflight.get(addr, 0) + 1
        if env_id or addr not in self._env_of:
            self._env_of[addr] = env_id

    def release(self, addr: str) -> None:
        remaining = self._inflight.get(addr, 0) - 1
        if remaining > 0:
            self._inflight[addr] = remaining
        else:
            self._inflight.pop(addr, None)
            self._env_of.pop(addr, None)

    def old_inflight(self, routed: Callable[[str], Collection[str]]) -> dict[str, int]:
        """Env id → requests in flight to addresses the env's current endpoints (``routed(env_id)``) no
        longer list: what an old release still serves after a promotion (issue 42, the drain)."""
        old: dict[str, int] = {}
        for addr, count in self._inflight.items():
            env_id = self._env_of.get(addr, "")
            if addr not in routed(env_id):
                old[env_id] = old.get(env_id, 0) + count
        return old

    def pick_weighted(self, endpoints: Sequence[cpb.Endpoint], cap: int = 0) -> cpb.Endpoint | None:
        """A weighted (canary) route: a release drawn by its share (``release_weight``, basis points) among
        those with an endpoint under ``cap``, then P2C among that release's endpoints (issue 41)."""
        shares: dict[str, int] = {}
        for e in endpoints:
            if e.healthy and (cap == 0 or self._inflight.get(e.addr, 0) < cap):
                shares[e.release_id] = e.release_weight
        total = sum(shares.values())
        if total <= 0:
            return self.pick(endpoints, cap)
        draw = self._rng.randrange(total)
        chosen = ""
        for release_id, share in shares.items():
            if draw < share:
                chosen = release_id
                break
            draw -= share
        return self.pick([e for e in endpoints if e.release_id == chosen], cap)

    def pick(self, endpoints: Sequence[cpb.Endpoint], cap: int = 0) -> cpb.Endpoint | None:
        """P2C over healthy endpoints under ``cap`` (0 = no cap); None when none qualifies."""
        inflight = self._inflight
        candidates = [e for e in endpoints if e.healthy and (cap == 0 or inflight.get(e.addr, 0) < cap)]
        count = len(candidates)
        if count <= 1:
            return candidates[0] if candidates else None
        i = self._rng.randrange(count)
        j = self._rng.randrange(count - 1)
        if j >= i:
            j += 1
        first, second = candidates[i], candidates[j]
        first_load, second_load = inflight.get(first.addr, 0), inflight.get(second.addr, 0)
        if first_load != second_load:
            return first if first_load < second_load else second
        if self.node_id and second.node_id == self.node_id and first.node_id != self.node_id:
            return second
        return first
