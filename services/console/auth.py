"""Console sessions, CSRF tokens and login rate limiting: pure state driven by an injected clock.

A session is a random 256-bit token in an HttpOnly, SameSite=Strict cookie; the server keeps only its
SHA-256, with the user, role, expiry and the session's CSRF token (sent back in every form and checked on
every action). Sessions live in the console process: a restart logs everybody out, which is the safe
direction.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import deque
from dataclasses import dataclass, replace

from shared.clock import Clock

SESSION_COOKIE = "zattera_session"
LOGIN_COOKIE = "zattera_login"
"""Double-submit token of the login form: a login needs the page it came from (no login CSRF)."""


@dataclass(frozen=True, slots=True)
class Session:
    user: str
    role: str
    csrf: str
    expires_at: float


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_equal(a: str, b: str) -> bool:
    return bool(a) and hmac.compare_digest(a.encode(), b.encode())


class Sessions:
    def __init__(self, clock: Clock, ttl: float) -> None:
        self._clock = clock
        self._ttl = ttl
        self._by_digest: dict[str, Session] = {}

    def open(self, user: str, role: str) -> tuple[str, Session]:
        """A new session: returns the cookie token (kept by the browser only) and the session."""
        self._expire()
        token = secrets.token_urlsafe(32)
        session = Session(user, role, secrets.token_urlsafe(32), self._clock.now() + self._ttl)
        self._by_digest[_digest(token)] = session
        return token, session

    def get(self, token: str) -> Session | None:
        if not token:
            return None
        session = self._by_digest.get(_digest(token))
        if session is None or session.expires_at <= self._clock.now():
            self._by_digest.pop(_digest(token), None)
            return None
        return session

    def set_role(self, token: str, role: str) -> Session:
        session = replace(self._by_digest[_digest(token)], role=role)
        self._by_digest[_digest(token)] = session
        return session

    def close(self, token: str) -> None:
        self._by_digest.pop(_digest(token), None)

    def _expire(self) -> None:
        now = self._clock.now()
        for digest in [d for d, s in self._by_digest.items() if s.expires_at <= now]:
            del self._by_digest[digest]


class LoginLimiter:
    """At most ``failures`` failed logins per ``window`` seconds for one client address, and for one user
    name (from any address); beyond that logins are refused until the oldest failure leaves the window."""

    def __init__(self, clock: Clock, failures: int, window: float) -> None:
        self._clock = clock
        self._failures = failures
        self._window = window
        self._seen: dict[str, deque[float]] = {}

    def _recent(self, key: str) -> deque[float]:
        times = self._seen.setdefault(key, deque())
        horizon = self._clock.now() - self._window
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def retry_after(self, address: str, user: str) -> float:
        """Seconds until a login for ``user`` from ``address`` may be tried; 0 = now."""
        waits = [
            times[0] + self._window - self._clock.now()
            for times in (self._recent(f"addr:{address}"), self._recent(f"user:{user}"))
            if len(times) >= self._failures
        ]
        return max(waits, default=0.0)

    def failed(self, address: str, user: str) -> None:
        now = self._clock.now()
        for key in (f"addr:{address}", f"user:{user}"):
            self._recent(key).append(now)
        if len(self._seen) > 10_000:  # bound memory under a spray of names: drop the empty windows
            for key in [k for k in self._seen if not self._recent(k)]:
                del self._seen[key]

    def succeeded(self, user: str) -> None:
        self._seen.pop(f"user:{user}", None)
