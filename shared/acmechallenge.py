"""HTTP-01 challenge answers: published in NATS by the certificate loop, answered by every proxy.

While an order is pending, the certificate loop puts ``acme.<token>`` → key authorization in the live
bucket (``zattera-live``, whose message age limit also bounds a forgotten answer) and deletes it when the
order ends. :class:`ChallengeAnswers` follows those keys, so any proxy the name's DNS points at answers
``GET /.well-known/acme-challenge/<token>`` before route matching (docs/certificates.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared.live import ACME_CHALLENGE
from shared.natsio import LIVE_PREFIX, LIVE_STREAM, Connection
from shared.tasks import raise_if_cancelling, stop_following
from shared.view import CONSUMER_HEARTBEAT, guard_ordered_consumer

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
    """token → key authorization, followed from the live bucket; :meth:`answer` for a request path."""

    def __init__(self) -> None:
        self._answers: dict[str, str] = {}
        self._sub: Subscription | None = None
        self._conn: Connection | None = None
        self._task: asyncio.Task[None] | None = None

    def answer(self, path: str) -> str | None:
        """The body to serve for ``path`` (``/.well-known/acme-challenge/<token>``) as followed so far."""
        token = path[len(PATH_PREFIX) :] if path.startswith(PATH_PREFIX) else ""
        return self._answers.get(token) if valid_token(token) else None

    async def lookup(self, path: str) -> str | None:
        """:meth:`answer`, else the key read directly: the loop publishes an answer (acknowledged) before it
        tells the CA to validate, so a validation that outruns this proxy's watch still finds it."""
        found = self.answer(path)
        token = path[len(PATH_PREFIX) :] if path.startswith(PATH_PREFIX) else ""
        if found is not None or not valid_token(token) or self._conn is None:
            return found
        try:
            msg = await self._conn.js.get_last_msg(LIVE_STREAM, challenge_key(token), direct=True)
        except Exception:  # not there (or NATS unreachable): nothing to answer
            return None
        headers = msg.headers or {}
        if not msg.data or headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return bytes(msg.data).decode()

    def __len__(self) -> int:
        return len(self._answers)

    async def start(self, conn: Connection) -> None:
        """Follow the answers in the background (never raises: until the watch is up — a cluster not
        provisioned yet, a server that refuses — answers are read directly)."""
        self._conn = conn
        self._task = asyncio.create_task(self._watch(conn))

    async def _watch(self, conn: Connection) -> None:
        async def on_msg(msg: Msg) -> None:
            token = msg.subject[len(challenge_key("")) :]
            headers = msg.headers or {}
            if headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers or not msg.data:
                self._answers.pop(token, None)
            else:
                self._answers[token] = msg.data.decode()

        wait = RETRY_INITIAL
        while self._sub is None:
            try:
                # A named consumer filtered on exactly these keys: what a proxy's credential may create.
                self._sub = await conn.js.subscribe(
                    challenge_key("*"),
                    stream=LIVE_STREAM,
                    cb=on_msg,
                    ordered_consumer=True,
                    config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, name=consumer_name()),
                    idle_heartbeat=CONSUMER_HEARTBEAT,
                )
            except Exception as exc:
                raise_if_cancelling()
                log.warning("acme answers: not watched yet (%s); retrying in %.0fs", type(exc).__name__, wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, RETRY_MAX)
        guard_ordered_consumer(self._sub, consumer_name)

    async def stop(self) -> None:
        self._conn = None
        await stop_following(self._task, self._sub)
        self._task, self._sub = None, None
