"""The console suite's fixture: the rig's seeded state and users, and a console serving them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import Running, add_users, running_console, seed


@pytest.fixture
async def console(conn: Connection, view: StateView, writer: Writer) -> AsyncIterator[Running]:
    await seed(writer)
    await add_users(conn)
    async with running_console(conn, view, writer) as running:
        yield running
