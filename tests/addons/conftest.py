"""The add-on tests' operator context (acting as ``tester`` on real NATS, as tests/actions does)."""

from __future__ import annotations

import pytest

from shared.actions.context import ActionContext
from shared.connection import Connection
from shared.txn import Writer
from tests.actions.conftest import ACTOR


@pytest.fixture
def ctx(conn: Connection, writer: Writer) -> ActionContext:
    return ActionContext(conn, writer, ACTOR)
