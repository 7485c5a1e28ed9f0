"""The delivery gate of git webhooks (docs/git.md, "Webhooks and previews"), on every secrets replica.

:class:`HookGate` answers the console's ``zattera.githooks.deliver`` requests (queue group): it opens the
hook's sealed secret (only this service holds the key), verifies the delivery (:func:`shared.githooks.verify`),
and publishes it to the ``ZATTERA_GITHOOKS`` stream with ``Nats-Msg-Id`` = ``<hook>:<delivery id>``:
JetStream refuses a second one within the duplicate window, so a replayed delivery is answered 409 and
nothing more happens. The console answers the git host at once (202): no git, no build on the request's path.
"""

import asyncio
import json
import logging
from collections.abc import Callable

from nacl.exceptions import CryptoError
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import githooks as G
from shared.connection import Connection
from shared.provisioning import recorded_config
from shared.secrets import SECRETS_QUEUE, Keyring, unseal
from shared.subjects import GITHOOKS_DELIVER_SUBJECT, GITHOOKS_DELIVERY_PREFIX, GITHOOKS_STREAM

log = logging.getLogger(__name__)

DUPLICATE_WINDOW = 24 * 3600.0
"""Seconds a delivery id is remembered: a replay within it is refused (JetStream's dedupe window)."""
MAX_DELIVERIES = 10_000
"""The stream keeps at most this many deliveries (and each at most the duplicate window): bounded."""

HOOK_HEADER = "Zattera-Hook"
PROVIDER_HEADER = "Zattera-Provider"


def stream_config(replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=GITHOOKS_STREAM,
        subjects=[GITHOOKS_DELIVERY_PREFIX + ">"],
        duplicate_window=DUPLICATE_WINDOW,
        max_age=DUPLICATE_WINDOW,
        max_msgs=MAX_DELIVERIES,
        max_msg_size=G.MAX_BODY + 16 * 1024,
        num_replicas=replicas,
    )


async def ensure_stream(conn: Connection, replicas: int = 0) -> None:
    """Create the deliveries stream unless it exists (the secrets service does at start), with the cluster's
    recorded stream replicas (``replicas`` 0)."""
    try:
        await conn.js.stream_info(GITHOOKS_STREAM)
    except NotFoundError:
        if not replicas:
            recorded = await recorded_config(conn.js)
            replicas = recorded.replicas if recorded is not None else 1
        await conn.js.add_stream(stream_config(replicas))


def open_hook(keyring: Keyring | None, hook: pb.GitHook) -> dict[str, str]:
    """The hook's ``secret`` and ``token`` ({} when the key is not held or does not open them)."""
    key = keyring.by_id(hook.key_id) if keyring is not None else None
    if key is None or not hook.sealed:
        return {}
    try:
        opened = json.loads(unseal(key, hook.sealed))
    except (CryptoError, ValueError):
        return {}
    return {str(k): str(v) for k, v in opened.items()} if isinstance(opened, dict) else {}


def _answer(status: int, message: str) -> bytes:
    return json.dumps({"status": status, "message": message}).encode()


class HookGate:
    """Verifies deliveries and queues the genuine, unseen ones (any secrets replica)."""

    def __init__(
        self, conn: Connection, view_get: Callable[[str], pb.GitHook | None], keyring: Callable[[], Keyring | None]
    ) -> None:
        self._conn = conn
        self._hook = view_get
        self._keyring = keyring
        self._sub: Subscription | None = None

    async def start(self, replicas: int = 0) -> None:
        """Create the stream when missing and answer deliveries from now on."""
        await ensure_stream(self._conn, replicas)
        self._sub = await self._conn.nc.subscribe(GITHOOKS_DELIVER_SUBJECT, queue=SECRETS_QUEUE, cb=self._on_delivery)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def serve(self, replicas: int = 0) -> None:
        await self.start(replicas)
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def _on_delivery(self, msg: Msg) -> None:
        try:
            status, message = await self.admit(dict(msg.headers or {}), msg.data)
        except Exception:
            log.exception("git hook delivery")
            status, message = 503, "the delivery could not be queued; the git host may redeliver it"
        if msg.reply:
            await msg.respond(_answer(status, message))

    async def admit(self, headers: dict[str, str], body: bytes) -> tuple[int, str]:
        """(HTTP status, message) for one delivery: 202 queued, 401 unsigned or forged, 404 no such hook,
        409 replayed, 503 the key is not held."""
        hook_id, provider = headers.get(HOOK_HEADER, ""), headers.get(PROVIDER_HEADER, "")
        hook = self._hook(hook_id) if hook_id else None
        if hook is None or hook.provider != provider:
            return 404, "no such hook"
        opened = open_hook(self._keyring(), hook)
        if "secret" not in opened:
            return 503, "the secrets service cannot open this hook's secret (see docs/secrets.md)"
        try:
            G.verify(provider, opened["secret"], headers, body)
            delivery = G.delivery_id(provider, headers)
        except G.DeliveryRefused as refused:
            return refused.status, refused.message
        event_name = headers.get(G.HEADERS[provider].event, "")
        ack = await self._conn.js.publish(
            GITHOOKS_DELIVERY_PREFIX + hook_id,
            body,
            stream=GITHOOKS_STREAM,
            headers={"Nats-Msg-Id": f"{hook_id}:{delivery}", "Zattera-Event": event_name, HOOK_HEADER: hook_id},
        )
        if ack.duplicate:
            return 409, f"refused: delivery {delivery} was received before (a replay)"
        return 202, f"queued delivery {delivery}"
