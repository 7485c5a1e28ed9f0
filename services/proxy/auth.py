"""Basic auth and the HTTPS redirect of a route's middleware (``zattera.v1.Middleware``).

A route lets a request in when its ``Authorization: Basic`` credentials match one of the route's users:
the ``basic_auth_username`` / ``basic_auth_password_hash`` pair or any ``basic_auth_users`` entry, each
with a bcrypt hash. bcrypt is slow on purpose (~0.1-0.3 s per check at the usual costs), so a check runs
in a worker thread, never on the event loop, and credentials that passed are remembered (keyed by the
hash and a SHA-256 of what the client sent, bounded, least recently used dropped first): a logged-in
client costs one dictionary lookup per request. Failures are not remembered, so a guessed password costs
the guesser a bcrypt check each time.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections import OrderedDict

import bcrypt
from zattera.v1 import types_pb2 as pb

REMEMBERED_LOGINS = 4096


def route_users(middleware: pb.Middleware) -> dict[str, str]:
    """username → bcrypt hash of every user the route lets in (empty: no basic auth)."""
    users = {u.username: u.password_hash for u in middleware.basic_auth_users if u.username}
    if middleware.basic_auth_username:
        users.setdefault(middleware.basic_auth_username, middleware.basic_auth_password_hash)
    return users


def parse_basic(authorization: str) -> tuple[str, str] | None:
    """(username, password) of an ``Authorization: Basic …`` header; None when absent or malformed."""
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    username, sep, password = decoded.partition(":")
    return (username, password) if sep else None


def _check(password: str, password_hash: str) -> bool:
    try:
        return bcrypt.checkpw(password.encode("utf-8"), password_hash.encode("ascii"))
    except ValueError:  # not a bcrypt hash: nobody gets in with it
        return False


class BasicAuth:
    def __init__(self, remembered: int = REMEMBERED_LOGINS) -> None:
        self._passed: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._remembered = remembered

    async def admits(self, users: dict[str, str], authorization: str) -> bool:
        credentials = parse_basic(authorization)
        if credentials is None:
            return False
        username, password = credentials
        password_hash = users.get(username)
        if password_hash is None:
            return False
        key = (password_hash, hashlib.sha256(f"{username}:{password}".encode()).digest())
        if key in self._passed:
            self._passed.move_to_end(key)
            return True
        if not await asyncio.to_thread(_check, password, password_hash):
            return False
        self._passed[key] = None
        if len(self._passed) > self._remembered:
            self._passed.popitem(last=False)
        return True


def is_https(scheme: str, forwarded_proto: str) -> bool:
    """The request came over HTTPS: to this listener, or to a TLS terminator in front of it that says so in
    ``X-Forwarded-Proto`` (its first value)."""
    return scheme == "https" or forwarded_proto.split(",")[0].strip().lower() == "https"


def https_location(host: str, path_qs: str) -> str:
    return f"https://{host}{path_qs}"
