"""``zattera cluster replicas N`` on a real three-server JetStream cluster: every stream moved to three copies
(one per machine tag), the count recorded, data kept, and the refusals (too few machines, a bad count)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.errors import NoRespondersError
from nats.js.api import Placement
from nats.js.errors import NoStreamResponseError
from nats.js.kv import KeyValue

from shared.actions.refusals import Conflicting, Invalid
from shared.actions.replicas import ChangeReplicas, change_replicas
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats, start_cluster, wait_meta_group
from shared.provisioning import inspect_cluster, provision, recorded_replicas
from shared.replicas import CLUSTER_REPLICAS_SUBJECT, handler, plan
from shared.subjects import STATE_STREAM
from shared.watch_server import serve
from tests.waiting import retried


def _cluster(base: Path, tags: list[str]) -> list[EmbeddedNats]:
    servers = start_cluster(base, 3, name="replicas", unique_tag="machine:", tags=[(f"machine:{t}",) for t in tags])
    wait_meta_group(servers)
    return servers


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EmbeddedNats]]:
    """Three servers on three machines (distinct tags)."""
    servers = _cluster(tmp_path_factory.mktemp("machines"), ["m1", "m2", "m3"])
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


async def _control(servers: list[EmbeddedNats]) -> AsyncIterator[Connection]:
    conn = await connect(",".join(s.url for s in servers), name="test-join")
    await provision(conn.js, replicas=1)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(conn, CLUSTER_REPLICAS_SUBJECT, handler(conn.nc), ready))
    await ready.wait()
    try:
        yield conn
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await conn.close()


@pytest.fixture
async def control(machines: list[EmbeddedNats]) -> AsyncIterator[Connection]:
    async for conn in _control(machines):
        yield conn


async def put_once_reachable(kv: KeyValue, key: str, value: bytes, timeout: float = 10.0) -> None:
    """A put sent again while the stream is not reached yet: a stream just created on one server is not
    reached from a client of another for some milliseconds ("no responders": nothing was stored)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await kv.put(key, value)
            return
        except NoStreamResponseError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_every_stream_moves_to_three_copies_and_the_count_is_recorded(control: Connection) -> None:
    kv = await control.js.key_value("zattera-state")
    await put_once_reachable(kv, "env.demo.web.production", b"kept")
    assert await recorded_replicas(control.js) == 1
    seen: list[str] = []
    result = await change_replicas(control.nc, ChangeReplicas(3, timeout=60), lambda s: seen.append(s.stream))
    assert seen[-1] == STATE_STREAM, "the state stream (which records the count) goes last"
    assert result.recorded_before == 1 and result.changed == len(result.streams) >= 6
    for stream in result.streams:
        assert (stream.before, stream.after, stream.current) == (1, 3, 3)
        assert len(set(stream.servers)) == 3, "one copy per machine"
    _, streams = await inspect_cluster(control.js)
    assert {s.name: s.replicas for s in streams if s.exists} == {s.stream: 3 for s in result.streams} | {
        s.name: 3 for s in streams if s.exists
    }
    assert await recorded_replicas(control.js) == 3
    assert (await kv.get("env.demo.web.production")).value == b"kept"

    again = await change_replicas(control.nc, ChangeReplicas(3, timeout=60))
    assert again.changed == 0 and again.recorded_before == 3

    back = await change_replicas(control.nc, ChangeReplicas(1, timeout=60))
    assert back.changed == len(back.streams) and await recorded_replicas(control.js) == 1
    assert (await kv.get("env.demo.web.production")).value == b"kept"


@pytest.mark.parametrize("count", [2, 4, 7, 0])
async def test_a_count_other_than_one_three_or_five_is_refused(control: Connection, count: int) -> None:
    with pytest.raises(Invalid, match=r"^replicas: .*use 1, 3 or 5"):
        await change_replicas(control.nc, ChangeReplicas(count))
    raw = await control.nc.request(CLUSTER_REPLICAS_SUBJECT, b'{"replicas": 3, "stream": "X", "timeout": -1}')
    assert b"timeout: must be between" in raw.data


async def test_three_copies_on_one_machine_are_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    servers = _cluster(tmp_path, ["m1", "m1", "m1"])  # the first machine's three seats
    try:
        async for conn in _control(servers):
            with pytest.raises(Conflicting, match="fewer than 3 server machines"):
                await change_replicas(conn.nc, ChangeReplicas(3, timeout=30))
            _, streams = await inspect_cluster(conn.js)
            assert {s.replicas for s in streams if s.exists} == {1}
            assert await recorded_replicas(conn.js) == 1
    finally:
        for server in servers:
            server.stop()


def _meta_leader(server: EmbeddedNats) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/jsz", timeout=5) as resp:
        return str(json.loads(resp.read())["meta_cluster"].get("leader") or "")


async def _plan_asked(urls: str) -> dict[str, Any]:
    """The plan as the CLI asks it, from a connection of its own, asked again while no join service answers
    ("no responders": the service reconnecting after its server stopped)."""
    asker = await connect(urls, name="test-asker")
    try:
        ask = functools.partial(asker.nc.request, CLUSTER_REPLICAS_SUBJECT, b'{"replicas": 1}', timeout=60)
        answer: dict[str, Any] = json.loads((await retried(ask, (NoRespondersError,), timeout=60)).data)
        return answer
    finally:
        await asker.close()


async def test_the_plan_answers_with_a_server_down_its_streams_offline(tmp_path: Path) -> None:
    """A server stopped (not the meta leader, the one the join service is connected to): the streams whose only
    copy it held are listed without a leader and with no copy current, every other stream answered as caught
    up; through the handler, a plan, not a refusal."""
    servers = _cluster(tmp_path, ["m1", "m2", "m3"])
    try:
        leader = _meta_leader(servers[0])
        down = next(s for s in servers if s.name != leader)
        staying = ",".join(s.url for s in servers if s is not down)
        async for conn in _control([down]):  # the service's connection moves to another server when it stops
            tag = f"machine:m{servers.index(down) + 1}"
            await conn.js.add_stream(name="ONLY", subjects=["only.>"], num_replicas=1, placement=Placement(tags=[tag]))
            before = {s["stream"]: s for s in (await plan(conn.nc))["streams"]}
            assert before["ONLY"]["servers"] == (down.name,) and before["ONLY"]["leader"] == down.name
            assert all(s["leader"] and s["current"] == 1 for s in before.values())
            on_down = {name for name, s in before.items() if s["servers"] == (down.name,)}

            down.stop()
            answer = await _plan_asked(staying)
            assert "refused" not in answer, answer
            after = {s["stream"]: s for s in answer["streams"]}
            assert set(after) == set(before) and answer["streams"][-1]["stream"] == STATE_STREAM
            for name, stream in after.items():
                if name in on_down:
                    assert (stream["leader"], stream["current"], stream["servers"]) == ("", 0, [down.name]), stream
                else:
                    assert stream["leader"] and stream["current"] == 1, stream
    finally:
        for server in servers:
            server.stop()
