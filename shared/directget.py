"""The last message of every subject of a stream in one ``DIRECT.GET`` batch request, answered by any
current replica (no consumer, no leader needed)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.connection import ClusterUnavailable
from shared.errors import ZatteraError
from shared.subjects import JS_API_PREFIX

DIRECT_GET_PREFIX = f"{JS_API_PREFIX}DIRECT.GET."


DIRECT_GET_STATUS = "Status"


END_OF_BATCH = "204"


NO_RESULTS = "404"


TOO_MANY_RESULTS = "413"


class TooManySubjects(ZatteraError):
    """More subjects than the server returns in one ``multi_last`` direct get (1,024 in nats-server)."""


async def last_per_subject(nc: NATS, stream: str, subjects: str, timeout: float) -> list[Msg]:
    """The last message of every subject matching ``subjects`` (deletes and markers included), read with ONE
    ``DIRECT.GET`` batch request (``multi_last``): answered by any current replica of a stream that allows
    direct reads, so without a consumer and without its leader — it works while the stream elects one.
    The reply is one point in the stream's history. Raises :class:`TimeoutError` when no message arrives
    within ``timeout`` of the last, ``nats.errors.NoRespondersError`` / :class:`ClusterUnavailable` when
    nobody answers (no replica: an election's first instants, or no such stream), :class:`TooManySubjects`."""
    inbox = nc.new_inbox()
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        replies.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        request = json.dumps({"multi_last": [subjects]}).encode()
        await nc.publish(DIRECT_GET_PREFIX + stream, request, reply=inbox)
        found: list[Msg] = []
        while True:
            msg = await asyncio.wait_for(replies.get(), timeout)
            status = (msg.headers or {}).get(DIRECT_GET_STATUS)
            if status is None:
                found.append(msg)
            elif status in (END_OF_BATCH, NO_RESULTS):
                return found
            elif status == TOO_MANY_RESULTS:
                raise TooManySubjects(f"{stream}: more subjects than one direct get returns")
            elif status == "503" and not found:
                raise nats.errors.NoRespondersError
            else:
                raise ClusterUnavailable(f"direct get of {stream} answered {status} {msg.headers}")
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
