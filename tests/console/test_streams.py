"""The console's live streams and its other actions over real HTTP: page changes naming the env, a build's log,
platform events, scaling and cordoning (each the CLI's write, refused with the field named)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from zattera.v1 import types_pb2 as pb

from shared.buildlogs import append_log_lines, close_log
from shared.connection import Connection
from shared.events import EventPublisher, make_event
from shared.state.feed import StateView
from shared.subjects import EVENTS_STREAM
from shared.txn import Writer
from tests.console.rig import ADMIN_USER, ENV_ID, Running
from tests.console.test_auth import client, csrf_of, log_in
from tests.waiting import eventually

Message = tuple[str, str]


@pytest.fixture
async def http(console: Running) -> AsyncIterator[aiohttp.ClientSession]:
    async with client() as session:
        await log_in(session, console.url, ADMIN_USER)
        yield session


async def _messages(response: aiohttp.ClientResponse) -> AsyncIterator[Message]:
    """Server-Sent Events as (event, data) pairs."""
    event, data = "", []
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data.append(line.removeprefix("data: "))
        elif not line and event:
            yield event, "\n".join(data)
            event, data = "", []


async def _next(messages: AsyncIterator[Message], event: str) -> dict[str, object]:
    async def find() -> dict[str, object]:
        async for name, data in messages:
            if name == event:
                found: dict[str, object] = json.loads(data)
                return found
        raise AssertionError(f"the stream ended before a {event!r} message")

    return await asyncio.wait_for(find(), 10)


async def test_a_page_hears_of_the_changes_it_shows_naming_the_env(
    console: Running, http: aiohttp.ClientSession, view: StateView, writer: Writer
) -> None:
    async with http.get(f"{console.url}/live?page=overview") as stream:
        messages = _messages(stream)
        assert "revision" in await _next(messages, "hello")
        env = pb.Environment()
        env.CopyFrom(view.env(ENV_ID))  # type: ignore[arg-type]
        env.effective_replicas = 3
        await writer.commit(writer.txn().put(env))
        assert await _next(messages, "change") == {"envs": [ENV_ID]}
    async with http.get(f"{console.url}/live?page=nowhere") as unknown:
        assert unknown.status == 404


async def test_a_builds_log_streams_until_it_ends(
    console: Running, http: aiohttp.ClientSession, conn: Connection, writer: Writer
) -> None:
    build = pb.Build(environment_id=ENV_ID, status=pb.BUILD_STATUS_RUNNING)
    build.meta.id = "01BUILD"
    await writer.commit(writer.txn().create(build))
    await append_log_lines(conn, "01BUILD", [(1, "Step 1/2: pip install"), (2, "<script>alert(1)</script>")])
    async with http.get(f"{console.url}/builds/01BUILD/logs") as stream:
        messages = _messages(stream)
        assert (await _next(messages, "line"))["text"] == "Step 1/2: pip install"
        assert (await _next(messages, "line"))["text"] == "<script>alert(1)</script>"  # shown as text by the page
        await close_log(conn, "01BUILD", pb.BUILD_STATUS_SUCCEEDED)
        assert [m async for m in messages if m[0] == "line"] == []  # the stream ends with the log
    async with http.get(f"{console.url}/builds/01NOSUCH/logs") as unknown:
        assert unknown.status == 404


async def test_events_stream_the_recent_ones_then_new_ones(
    console: Running, http: aiohttp.ClientSession, conn: Connection
) -> None:
    publisher = EventPublisher(conn)
    await publisher.publish(make_event("deploy.succeeded", "v2 is live", environment_id=ENV_ID))
    await eventually(lambda: _stored(conn, 1), what="the first event stored")
    async with http.get(f"{console.url}/events/stream") as stream:
        messages = _messages(stream)
        first = await _next(messages, "line")
        assert "deploy.succeeded shop/web/production v2 is live" in str(first["text"]) and not first["error"]
        await publisher.publish(make_event("node.down", "node n1 is down", severity="error", node_id="n1"))
        second = await _next(messages, "line")
        assert "node.down node n1 node n1 is down" in str(second["text"]) and second["error"]
    async with http.get(f"{console.url}/events/stream?env={ENV_ID}") as of_the_env:  # the env page's
        messages = _messages(of_the_env)
        assert "v2 is live" in str((await _next(messages, "line"))["text"])
        await publisher.publish(make_event("deploy.failed", "v3 failed", environment_id=ENV_ID))
        assert "v3 failed" in str((await _next(messages, "line"))["text"])  # the node's event is left out


async def _stored(conn: Connection, count: int) -> bool:
    info = await conn.js.stream_info(EVENTS_STREAM)
    return int(info.state.messages) >= count


async def test_scale_and_cordon_write_what_the_cli_writes_and_refusals_name_the_field(
    console: Running, http: aiohttp.ClientSession, view: StateView
) -> None:
    headers = {"X-CSRF-Token": await csrf_of(http, console.url), "Accept": "application/json"}
    scale = f"{console.url}/env/{ENV_ID}/scale"
    async with http.post(scale, data={"replicas": "9", "min": "2"}, headers=headers) as bad:
        assert bad.status == 409 and await bad.json() == {"error": "REPLICAS 9: outside --min 2 / --max 4"}
    async with http.post(scale, data={"replicas": "x"}, headers=headers) as bad:
        assert bad.status == 409 and await bad.json() == {"error": "replicas 'x': not a whole number"}
    async with http.post(scale, data={"replicas": "3"}, headers=headers) as done:
        assert done.status == 200
    env = view.env(ENV_ID)
    assert env is not None and (env.effective_replicas, env.service.replicas.min, env.service.replicas.max) == (3, 3, 3)
    async with http.post(f"{console.url}/nodes/n1/drain", headers=headers) as drained:
        assert drained.status == 200
    node = view.node("n1")
    assert node is not None and node.status == pb.NODE_STATUS_DRAINING and not node.schedulable
    async with http.post(scale, data=b"{not json", headers=headers | {"Content-Type": "application/json"}) as bad_body:
        assert bad_body.status == 400 and await bad_body.text() == "body: not valid JSON"
    async with http.post(f"{console.url}/nodes/n9/cordon", headers=headers) as missing:
        assert missing.status == 409 and await missing.json() == {"error": "node 'n9' not found"}
