"""``zattera addons psql`` sessions on a secured cluster (role accounts): the operator opens a session to
a node's agent and bytes flow both ways through the account imports (many replies to one request, credit
frames back), larger than the flow-control window; an agent may not open one."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.addons.tunnel import TunnelAgent, carry, open_subject
from shared.connection import Connection, connect
from shared.security.permissions import Role
from tests.security.conftest import ConnectAs, SecureCluster

NODE = "n1"
VOLUME = "01DATAVOL"


@pytest.fixture
async def echo_server(tmp_path: Path) -> AsyncIterator[Path]:
    """What stands for the database server: an echo on the socket path a PostgreSQL data volume has."""
    run = tmp_path / "volumes" / VOLUME / "run"
    run.mkdir(parents=True)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(echo, path=str(run / ".s.PGSQL.5432"))
    yield tmp_path / "volumes"
    server.close()


async def test_an_operator_session_through_the_role_accounts(secure: SecureCluster, echo_server: Path) -> None:
    agent_conn = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    operator: Connection = await connect(secure.url, name="cli", creds=secure.creds(Role.OPERATOR, "cli"))
    agent = TunnelAgent(agent_conn, NODE, echo_server)
    await agent.start()
    local = echo_server.parent / "local.sock"
    ended: list[str] = []
    done = asyncio.Event()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ended.append(await carry(operator, NODE, VOLUME, reader, writer))
        done.set()

    server = await asyncio.start_unix_server(accepted, path=str(local))
    try:
        reader, writer = await asyncio.open_unix_connection(str(local))
        payload = os.urandom(3 * 1024 * 1024)  # three windows

        async def send() -> None:
            writer.write(payload)
            await writer.drain()

        sender = asyncio.create_task(send())
        echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 60)
        await sender
        assert echoed == payload
        writer.close()
        await asyncio.wait_for(done.wait(), 15)
        assert ended == [""]
    finally:
        server.close()
        await agent.stop()
        await operator.close()
        await agent_conn.close()


async def test_an_agent_may_not_open_a_session(connect_as: ConnectAs) -> None:
    other = await connect_as(Role.AGENT, "n2")
    await other.nc.publish(open_subject(NODE), b"{}", reply=other.nc.new_inbox())
    assert await other.refusal() == f'nats: permissions violation for publish to "{open_subject(NODE)}"'
