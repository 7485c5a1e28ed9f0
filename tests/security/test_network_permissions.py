"""The agent's private-network forwarder on a secured cluster: it follows the route snapshots and asks
for activations like a proxy, and still may not publish a snapshot."""

from __future__ import annotations

import asyncio

from shared.connection import Connection
from shared.security.permissions import Role
from shared.subjects import ACTIVATE_SUBJECT, ROUTES_GET_SUBJECT, ROUTES_SNAPSHOT_SUBJECT
from tests.security.conftest import ConnectAs

NODE = "n1"


async def test_agent_follows_route_snapshots_and_asks_for_activations(
    connect_as: ConnectAs, control: Connection
) -> None:
    agent = await connect_as(Role.AGENT, NODE)
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_snapshot(msg: object) -> None:
        await got.put(getattr(msg, "data", b""))

    await agent.nc.subscribe(ROUTES_SNAPSHOT_SUBJECT, cb=on_snapshot)
    for subject in (ROUTES_GET_SUBJECT, ACTIVATE_SUBJECT):
        await agent.nc.publish(subject, b"", reply=agent.nc.new_inbox())
    await agent.nc.flush()
    assert await delivered(control, got) == b"snapshot"
    assert agent.errors == []


async def delivered(control: Connection, got: asyncio.Queue[bytes], timeout: float = 15.0) -> bytes:
    """The first snapshot the agent receives, control publishing one every half second: the agent's
    interest crosses from its account to the control one's export asynchronously, so a single publish
    right after the subscription can go to nobody on a loaded machine."""
    async with asyncio.timeout(timeout):
        while True:
            await control.nc.publish(ROUTES_SNAPSHOT_SUBJECT, b"snapshot")
            try:
                return await asyncio.wait_for(got.get(), 0.5)
            except TimeoutError:
                continue
