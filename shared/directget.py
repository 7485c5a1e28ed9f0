"""Batched ``DIRECT.GET`` requests, answered by any current replica (no consumer, no leader needed): the last
message of every subject of a stream in one request, or any other batch (the metrics history pages)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

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
    return await direct_batch(nc, stream, {"multi_last": [subjects]}, timeout)


async def direct_batch(nc: NATS, stream: str, request: dict[str, Any], timeout: float) -> list[Msg]:
    """The messages one batched ``DIRECT.GET`` request answers (``multi_last``, or ``next_by_subj`` with
    ``batch`` and ``seq``), up to its end. Raises as :func:`last_per_subject` does."""
    inbox = nc.new_inbox()
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        replies.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish(DIRECT_GET_PREFIX + stream, json.dumps(request).encode(), reply=inbox)
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
