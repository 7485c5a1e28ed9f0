"""The control side of watches: answering ``zattera.watch.open`` (the join service serves it) by creating
the requested pull consumer, after a team member's request passed its authoriser.

The reader's side, the request's contract and the consumer it creates are :mod:`shared.watches`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg

from shared.connection import Connection
from shared.security.callers import answerable
from shared.watches import WATCH_OPEN_SUBJECT, BadWatch, WatchSpec, create_watch_consumer

WatchAuthorizer = Callable[[Msg, WatchSpec], Awaitable[str]]
"""Why a caller may not open a watch ("" = it may): the teams' check (shared/security/authz.py)."""


def watch_open_handler(conn: Connection, authorize: WatchAuthorizer | None = None) -> Callable[[Msg], Awaitable[None]]:
    """Answers ``zattera.watch.open``. Any caller may ask (only operators, members and control may publish it,
    and a pull consumer has no deliver subject to steer); answers go only to a requester's reply subject.
    ``authorize``: a team member's watch is checked against its grants first (docs/teams.md)."""

    async def on_request(msg: Msg) -> None:
        if not answerable(msg):
            return
        reply: dict[str, str]
        try:
            spec = WatchSpec.from_json(msg.data)
            refused = await authorize(msg, spec) if authorize is not None else ""
            if refused:
                raise BadWatch(refused)
            reply = {"consumer": await create_watch_consumer(conn, spec)}
        except BadWatch as exc:
            reply = {"error": str(exc)}
        except nats.errors.Error as exc:
            reply = {"error": f"the watch could not be created: {exc}"}
        await conn.nc.publish(msg.reply, json.dumps(reply).encode())

    return on_request


async def serve(
    conn: Connection, subject: str, handler: Callable[[Msg], Awaitable[None]], ready: asyncio.Event | None = None
) -> None:
    """Answer ``subject`` with ``handler`` until cancelled (queue group named after the subject: any number of
    replicas share the work); ``ready`` is set once subscribed."""
    sub = await conn.nc.subscribe(subject, queue=subject, cb=handler)
    await conn.nc.flush()
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def serve_watches(
    conn: Connection, ready: asyncio.Event | None = None, authorize: WatchAuthorizer | None = None
) -> None:
    """Answer ``zattera.watch.open`` until cancelled."""
    await serve(conn, WATCH_OPEN_SUBJECT, watch_open_handler(conn, authorize), ready)
