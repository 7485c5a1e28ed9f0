"""The console's Server-Sent Events: ``/live`` (something a page shows changed), an env's log lines, a build's
log and the events, each streamed as it comes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from aiohttp import web
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from services.console.handling import console_of
from services.console.metrics_views import env_or_404
from shared import keys as K
from shared.applogs import AppLogLine, UnknownLogStream, read_app_logs
from shared.buildlogs import follow_build_log
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX

from . import pages

HEARTBEAT = 15.0
"""An SSE comment this often keeps proxies from closing an idle stream."""


EVENTS_BACKLOG = 100


LOG_BACKLOG = 100


LOG_STREAM_RETRY = 1.0


async def _sse(request: web.Request, messages: AsyncIterator[tuple[str, str]]) -> web.StreamResponse:
    """Stream ``(event, data)`` pairs as Server-Sent Events until the client leaves or the console stops."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
    await response.prepare(request)
    await response.write(b"retry: 1000\n\n")
    source = aiter(messages)
    pending: asyncio.Task[tuple[str, str]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=HEARTBEAT)
            if not done:
                await response.write(b": keep-alive\n\n")
                continue
            try:
                event, data = pending.result()
            except StopAsyncIteration:
                break
            pending = None
            payload = "".join(f"data: {line}\n" for line in data.split("\n"))
            await response.write(f"event: {event}\n{payload}\n".encode())
    except ConnectionResetError:
        pass  # the browser left
    finally:
        if pending is not None:
            pending.cancel()
        with contextlib.suppress(Exception):
            await source.aclose()  # type: ignore[attr-defined]
    return response


async def live(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    page = request.query.get("page", "")
    only_env = request.query.get("env", "")
    kinds = pages.kinds_of_page(page)
    if not kinds:
        raise web.HTTPNotFound(text="page: unknown")

    async def changes() -> AsyncIterator[tuple[str, str]]:
        feed = console.view.subscribe(kinds)
        try:
            # The page compares this with the revision it was rendered at: a change in between refreshes it.
            yield "hello", json.dumps({"revision": pages.page_revision(console.view, page)})
            while True:
                changes = await feed.wait()
                routed = pages.routed_envs(console.routes()) if any(k == K.CERT for k, _ in changes) else None
                changed = pages.changed_envs(console.view, changes, routed)
                if only_env and changed is not None and only_env not in changed:
                    continue  # another env's change: not on this env's page
                yield "change", json.dumps({"envs": changed})
        finally:
            feed.close()

    return await _sse(request, changes())


def _log_line(line: AppLogLine) -> str:
    stamp = datetime.fromtimestamp(line.time_ns / 1e9, tz=UTC).strftime("%H:%M:%S")
    text = f"{stamp} {line.instance[-6:]} {line.stream}: {line.line}"
    return json.dumps({"text": text, "error": line.stream == "stderr"})


async def env_logs(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    env_id = env_or_404(console, request.match_info["env_id"]).meta.id

    async def lines() -> AsyncIterator[tuple[str, str]]:
        while True:
            try:
                async for line in read_app_logs(console.conn, env_id, last=LOG_BACKLOG, follow=True, idle=0.2):
                    yield "line", _log_line(line)
                return
            except UnknownLogStream:
                await asyncio.sleep(LOG_STREAM_RETRY)  # the builds service creates it with the env

    return await _sse(request, lines())


async def build_logs(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    build_id = request.match_info["build_id"]
    if console.view.build(build_id) is None:
        raise web.HTTPNotFound()

    async def lines() -> AsyncIterator[tuple[str, str]]:
        async for line in follow_build_log(console.conn, build_id):
            yield "line", json.dumps({"text": line, "error": False})

    return await _sse(request, lines())


async def events_stream(request: web.Request) -> web.StreamResponse:
    """The last events (of one env with ``?env=ID``), then new ones as they are published."""
    console = console_of(request)
    only_env = request.query.get("env", "")

    async def lines() -> AsyncIterator[tuple[str, str]]:
        js = console.conn.js
        try:
            info = await js.stream_info(EVENTS_STREAM)
        except NotFoundError:
            return
        start = max(1, int(info.state.last_seq) - EVENTS_BACKLOG + 1)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        sub = await js.subscribe(
            EVENTS_SUBJECT_PREFIX + ">", stream=EVENTS_STREAM, ordered_consumer=True, config=config
        )
        try:
            while True:
                msg = await sub.next_msg(timeout=None)
                decoded = pb.Event.FromString(msg.data)
                if only_env and decoded.environment_id != only_env:
                    continue
                event = pages.event_line(console.view, decoded)
                text = f"{event['at']} {event['kind']} {event['scope']} {event['message']}"
                yield "line", json.dumps({"text": text, "error": event["severity"] != "info"})
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    return await _sse(request, lines())
