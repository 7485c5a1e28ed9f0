"""Following a pull consumer someone else created, each message handled as soon as it arrives.

nats-py's ``fetch`` returns a batch only once it is full or its wait has run out, so a change would wait up
to that long; a view must see it at once. :class:`PullFeed` keeps one pull request outstanding on its own
inbox — the first with ``no_wait`` (it tells an empty backlog at once: status 404), the next ones long-polls
with idle heartbeats — and hands every message to its callback on arrival. Silence longer than three
heartbeats (the server or the stream's leader lost), a 409 (consumer deleted) or a 503 (no such consumer)
ends :meth:`run` with :class:`PullLost`; the owner opens the consumer again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.errors import ZatteraError

STATUS_HEADER = "Status"
HEARTBEAT, NO_MESSAGES, REQUEST_TIMEOUT = "100", "404", "408"
NANOS = 1_000_000_000


class PullLost(ZatteraError):
    """The consumer stopped answering or said it is gone."""


class PullFeed:
    def __init__(
        self,
        nc: NATS,
        stream: str,
        consumer: str,
        on_msg: Callable[[Msg], Awaitable[None]],
        on_caught_up: Callable[[], None],
        *,
        batch: int = 1024,
        wait: float = 5.0,
        heartbeat: float = 1.0,
    ) -> None:
        self._nc = nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._on_msg = on_msg
        self._on_caught_up = on_caught_up
        self._batch = batch
        self._wait = wait
        self._heartbeat = heartbeat
        self._inbox = nc.new_inbox()
        self._finished = asyncio.Event()
        self._remaining = 0
        self._heard = time.monotonic()
        self._failure = ""
        self._status = ""

    async def run(self) -> None:
        """Pull until cancelled; raises :class:`PullLost` when the consumer is gone or silent."""
        sub = await self._nc.subscribe(self._inbox, cb=self._on_delivery)
        try:
            first = True
            while True:
                await self._request(first)
                if self._failure:
                    raise PullLost(self._failure)
                if self._status == NO_MESSAGES:
                    self._on_caught_up()
                first = False
        finally:
            await sub.unsubscribe()

    async def _request(self, no_wait: bool) -> None:
        self._finished.clear()
        self._remaining, self._status, self._heard = self._batch, "", time.monotonic()
        request: dict[str, object] = {"batch": self._batch}
        if no_wait:
            request["no_wait"] = True
        else:
            request["expires"] = int(self._wait * NANOS)
            request["idle_heartbeat"] = int(self._heartbeat * NANOS)
        await self._nc.publish(self._next, json.dumps(request).encode(), reply=self._inbox)
        silence = 3 * self._heartbeat
        while not self._finished.is_set():
            try:
                await asyncio.wait_for(self._finished.wait(), silence)
            except TimeoutError:
                if time.monotonic() - self._heard > silence:
                    raise PullLost(f"no message nor heartbeat for {silence:.0f}s") from None

    async def _on_delivery(self, msg: Msg) -> None:
        self._heard = time.monotonic()
        status = (msg.headers or {}).get(STATUS_HEADER) if not msg.data else None
        if not status:
            self._remaining -= 1
            if self._remaining <= 0:
                self._finished.set()
            await self._on_msg(msg)
            return
        if status == HEARTBEAT:
            return
        self._status = status
        if status not in (NO_MESSAGES, REQUEST_TIMEOUT):
            self._failure = f"{status} {(msg.headers or {}).get('Description', '')}".strip()
        self._finished.set()
