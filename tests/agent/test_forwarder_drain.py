"""The node forwarder's count for the orchestrator's drain (issue 42): connections still open to an
endpoint the newest snapshot no longer lists, per env — real sockets, snapshots fed as the route client
would; and the agent's heartbeat carrying them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.agent.forwarder import Forwarder
from services.agent.heartbeat import HeartbeatPublisher
from shared.clock import FakeClock
from shared.connection import Connection
from shared.embedded import free_port
from tests.agent.test_forwarder import Echo, consumer, service, snapshot
from tests.waiting import eventually


@pytest.fixture
async def forwarder() -> AsyncIterator[Forwarder]:
    fw = Forwarder(dns_port=free_port(), hold_timeout=10)
    yield fw
    await fw.close()


async def test_a_connection_open_to_the_old_release_is_counted_until_it_closes(forwarder: Forwarder) -> None:
    db_port = free_port()
    old, new = await Echo("old").start(), await Echo("new").start()
    try:
        await forwarder.apply(snapshot(1, service(db_port, old.addr)))
        env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
        host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
        reader, writer = await asyncio.open_connection(host, db_port)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.read(1024), 5) == b"old:hello"
        assert forwarder.old_connections() == {}  # the old release is still the routed one

        await forwarder.apply(snapshot(2, service(db_port, new.addr)))  # the promotion
        assert forwarder.old_connections() == {"db-env": 1}
        assert forwarder.version == 2

        writer.close()
        await eventually(lambda: forwarder.old_connections() == {}, 5, "the closed connection no longer counted")
    finally:
        await old.stop()
        await new.stop()


async def test_the_node_heartbeat_carries_the_forwarders_counts(conn: Connection, tmp_path: Path) -> None:
    def forwarding() -> tuple[dict[str, int], int]:
        return {"db-env": 2}, 7

    with_forwarder = HeartbeatPublisher(conn, "n1", tmp_path, dict, FakeClock(), forwarding=forwarding)
    hb = with_forwarder.sample()
    assert (dict(hb.forwarder_old_connections), hb.forwarder_routes_version, hb.forwarder_counts) == (
        {"db-env": 2},
        7,
        True,
    )
    without = HeartbeatPublisher(conn, "n1", tmp_path, dict, FakeClock()).sample()
    assert not without.forwarder_counts  # no forwarder on this node: an env with ports keeps its window
