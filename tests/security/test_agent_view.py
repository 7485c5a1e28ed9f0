"""An agent's StateView on a secured cluster: it pulls from the consumer control opens for it
(``zattera.view.open``) and loads and follows exactly the keys the agent may read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.agent import view_filters
from shared import keys as K
from shared.connection import Connection, connect
from shared.ids import new_id
from shared.security.join import JoinService
from shared.security.permissions import Role, view_consumer
from shared.security.views import ViewRefused, node_view_filters, request_view
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
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


async def test_a_pulled_view_syncs_follows_and_resyncs_on_an_agent_credential(
    control: Connection, agent_conn: Connection, join_service: JoinService
) -> None:
    rel = release()
    mine, theirs = assignment(NODE, rel.meta.id), assignment("someone-else", rel.meta.id)
    volume = pb.Volume(project_id="P1", environment_id="E1", name="data", node_id=NODE)
    volume.meta.id = new_id()
    env = pb.Environment(app_id="A1", name="prod")
    env.meta.id = new_id()
    for msg in (rel, mine, theirs, volume, env):
        await put(control, msg)

    view = pulled_view(agent_conn)
    await view.start(timeout=10)
    try:
        assert view.assignment(mine.meta.id) is not None
        assert view.release(rel.meta.id) is not None
        assert view.volume(volume.meta.id) is not None
        assert view.assignment(theirs.meta.id) is None and view.env(env.meta.id) is None
        assert [a.meta.id for a in view.assignments_by_node(NODE)] == [mine.meta.id]

        # Changes arrive through the pulls; a delete removes.
        second = assignment(NODE, rel.meta.id)
        await put(control, second)
        await delete(control, K.release(rel.meta.id))
        await eventually(lambda: view.assignment(second.meta.id) is not None, 10, "a new assignment")
        await eventually(lambda: view.release(rel.meta.id) is None, 10, "a deleted release")

        # A resync opens the consumer anew (last value per key) and diffs.
        feed = view.subscribe({K.ASSIGNMENT})
        await delete(control, K.assignment(NODE, mine.meta.id))
        await view.force_resync()
        await view.wait_fresh(5)
        assert view.assignment(mine.meta.id) is None and view.assignment(second.meta.id) is not None
        assert (K.ASSIGNMENT, mine.meta.id) in await feed.wait(5)

        # Its consumer gone (expired after the agent was away, deleted by an operator): the view reopens it.
        await control.js.delete_consumer(STATE_STREAM, view_consumer(NODE))
        third = assignment(NODE, rel.meta.id)
        await put(control, third)
        await eventually(lambda: view.assignment(third.meta.id) is not None, 15, "a change after the loss")
    finally:
        await view.stop()


def pulled_view(conn: Connection, node: str = NODE) -> StateView:
    return StateView(
        conn, name=f"agent-{node}", filters=view_filters(node), open_consumer=partial(request_view, conn, node)
    )


async def test_a_pulled_view_with_nothing_to_load_is_fresh_at_once(
    secure: SecureCluster, join_service: JoinService
) -> None:
    conn = await connect(secure.url, name="agent-empty", creds=secure.creds(Role.AGENT, "empty-node"))
    view = pulled_view(conn, "empty-node")
    try:
        await view.start(timeout=10)
        assert view.assignments_by_node("empty-node") == []
    finally:
        await view.stop()
        await conn.close()


def test_control_opens_the_consumer_the_agent_role_may_read() -> None:
    assert node_view_filters(NODE) == [STATE_PREFIX + pattern for pattern in view_filters(NODE)]


async def test_only_an_agent_credential_opens_a_view(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    with pytest.raises(ViewRefused, match="only an agent"):
        await request_view(control, NODE)  # no server-set caller identity: not an agent
    for role, name in ((Role.PROXY, "p1"), (Role.OPERATOR, "ops")):
        conn = await connect(secure.url, name=f"{role}-view", creds=secure.creds(role, name))
        try:
            with pytest.raises(ViewRefused, match="no view service answered"):
                await request_view(conn, name, timeout=1)  # its account does not import the service
        finally:
            await conn.close()
    agent = await connect(secure.url, name="agent-asks-for-another", creds=secure.creds(Role.AGENT, NODE))
    try:  # the node a secured request names does not count: the credential's does
        assert await request_view(agent, "someone-else") == view_consumer(NODE)
    finally:
        await agent.close()


async def test_view_filters_are_key_patterns(conn: Connection) -> None:
    with pytest.raises(ValueError, match="bad view filter"):
        StateView(conn, filters=(f"{STATE_PREFIX}release.*",))
    with pytest.raises(ValueError, match="bad view filter"):
        StateView(conn, filters=("",))
