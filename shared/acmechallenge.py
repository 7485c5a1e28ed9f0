"""HTTP-01 challenge answers: published in NATS by the certificate loop, answered by every proxy.

While an order is pending, the certificate loop puts ``acme.<token>`` → key authorization in the live
bucket (``zattera-live``, whose message age limit also bounds a forgotten answer) and deletes it when the
order ends. :class:`ChallengeAnswers` reads those keys, so any proxy the name's DNS points at answers
``GET /.well-known/acme-challenge/<token>`` before route matching (docs/certificates.md).
"""

from __future__ import annotations

import contextlib
import logging
import uuid

from shared.connection import Connection
from shared.jetstream import is_delete_marker
from shared.live import ACME_CHALLENGE
from shared.subjects import LIVE_PREFIX, LIVE_STREAM

log = logging.getLogger(__name__)

PATH_PREFIX = "/.well-known/acme-challenge/"
RETRY_INITIAL = 0.5
RETRY_MAX = 30.0
TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
"""RFC 8555 §8.3: a token is base64url; anything else is never looked up (nor a valid key)."""


def challenge_key(token: str) -> str:
    return f"{LIVE_PREFIX}{ACME_CHALLENGE}.{token}"


def consumer_name() -> str:
    return f"acme-answers-{uuid.uuid4().hex[:16]}"


def valid_token(token: str) -> bool:
    return 0 < len(token) <= 256 and set(token) <= TOKEN_CHARS


async def publish_answer(conn: Connection, token: str, key_authorization: str) -> None:
    await conn.js.publish(challenge_key(token), key_authorization.encode(), stream=LIVE_STREAM)


async def withdraw_answer(conn: Connection, token: str) -> None:
    with contextlib.suppress(Exception):  # the bucket's age limit removes it anyway
        await conn.js.publish(challenge_key(token), b"", stream=LIVE_STREAM, headers={"KV-Operation": "DEL"})


class ChallengeAnswers:
    """Answers ``GET /.well-known/acme-challenge/<token>`` from the live bucket by direct get: a CA asks a
    handful of times per order, so nothing is followed in the background, and a proxy needs no consumer
    (under ``--secure`` it may create none: SECURITY.md)."""

    def __init__(self) -> None:
        self._conn: Connection | None = None

    async def lookup(self, path: str) -> str | None:
        """The key authorization to serve for ``path``, or None (unknown token, withdrawn, NATS unreachable).
        The loop publishes an answer (acknowledged) before it tells the CA to validate, so it is there."""
        token = path[len(PATH_PREFIX) :] if path.startswith(PATH_PREFIX) else ""
        if not valid_token(token) or self._conn is None:
            return None
        try:
            msg = await self._conn.js.get_last_msg(LIVE_STREAM, challenge_key(token), direct=True)
        except Exception:  # not there (or NATS unreachable): nothing to answer
            return None
        if not msg.data or is_delete_marker(msg.headers):
            return None
        return bytes(msg.data).decode()

    async def start(self, conn: Connection) -> None:
        self._conn = conn

    async def stop(self) -> None:
        self._conn = None
