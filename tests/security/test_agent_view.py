"""A filtered StateView on an agent credential: it loads and follows exactly the keys the agent may read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.agent import view_filters
from shared import keys as K
from shared.ids import new_id
from shared.natsio import STATE_PREFIX, STATE_STREAM, Connection, connect
from shared.security.permissions import Role
from shared.view import StateView
from tests.security.conftest import SecureCluster
from tests.waiting import eventually

NODE = "viewer"


@pytest.fixture
async def agent_conn(secure: SecureCluster) -> AsyncIterator[Connection]:
    conn = await connect(secure.url, name="agent-view", creds=secure.creds(Role.AGENT, NODE))
    try:
        yield conn
    finally:
        await conn.close()


def assignment(node_id: str, release_id: str) -> pb.Assignment:
    a = pb.Assignment(node_id=node_id, release_id=release_id, environment_id="E1", project_id="P1")
    a.meta.id = new_id()
    return a


def release() -> pb.Release:
    r = pb.Release(environment_id="E1", project_id="P1", image_ref="exec:true")
    r.meta.id = new_id()
    return r


async def put(conn: Connection, msg: object) -> int:
    ack = await conn.js.publish(STATE_PREFIX + K.key_of(msg), K.encode(msg), stream=STATE_STREAM)  # type: ignore[arg-type]
    return int(ack.seq)


async def delete(conn: Connection, key: str) -> None:
    await conn.js.publish(STATE_PREFIX + key, b"", headers={"KV-Operation": "DEL"}, stream=STATE_STREAM)


async def test_a_filtered_view_syncs_follows_and_resyncs_on_an_agent_credential(
    control: Connection, agent_conn: Connection
) -> None:
    rel = release()
    mine, theirs = assignment(NODE, rel.meta.id), assignment("someone-else", rel.meta.id)
    volume = pb.Volume(project_id="P1", environment_id="E1", name="data", node_id=NODE)
    volume.meta.id = new_id()
    env = pb.Environment(app_id="A1", name="prod")
    env.meta.id = new_id()
    for msg in (rel, mine, theirs, volume, env):
        await put(control, msg)

    view = StateView(agent_conn, name=f"agent-{NODE}", filters=view_filters(NODE))
    await view.start(timeout=10)
    try:
        assert view.assignment(mine.meta.id) is not None
        assert view.release(rel.meta.id) is not None
        assert view.volume(volume.meta.id) is not None
        assert view.assignment(theirs.meta.id) is None and view.env(env.meta.id) is None
        assert [a.meta.id for a in view.assignments_by_node(NODE)] == [mine.meta.id]

        # Changes arrive on each filter's consumer; a delete removes.
        second = assignment(NODE, rel.meta.id)
        await put(control, second)
        await delete(control, K.release(rel.meta.id))
        await eventually(lambda: view.assignment(second.meta.id) is not None, 5, "a new assignment")
        await eventually(lambda: view.release(rel.meta.id) is None, 5, "a deleted release")

        # A resync creates new named consumers (the old names may still exist) and diffs.
        feed = view.subscribe({K.ASSIGNMENT})
        await delete(control, K.assignment(NODE, mine.meta.id))
        await view.force_resync()
        await view.wait_fresh(5)
        assert view.assignment(mine.meta.id) is None and view.assignment(second.meta.id) is not None
        assert (K.ASSIGNMENT, mine.meta.id) in await feed.wait(5)

        # An ordered-consumer reset (what nats-py does on a gap or missed heartbeats) re-creates the
        # consumer under a new name: under the old one the server would refuse it.
        sub = view._subs[0]
        before = sub._consumer
        await sub._sub._jsi.reset_ordered_consumer(view.last_revision + 1)
        await eventually(lambda: sub._consumer != before, 5, "the consumer re-created")
        third = assignment(NODE, rel.meta.id)
        await put(control, third)
        await eventually(lambda: view.assignment(third.meta.id) is not None, 5, "a change after the reset")
    finally:
        await view.stop()


async def test_a_filtered_view_with_nothing_to_load_is_fresh_at_once(agent_conn: Connection) -> None:
    view = StateView(agent_conn, name="empty", filters=(f"{K.ASSIGNMENT}.{NODE}.nothing-here",))
    await view.start(timeout=5)
    await view.stop()


def test_view_filters_are_key_patterns() -> None:
    with pytest.raises(ValueError, match="bad view filter"):
        StateView(filters=(f"{STATE_PREFIX}release.*",))
    with pytest.raises(ValueError, match="bad view filter"):
        StateView(filters=("",))
