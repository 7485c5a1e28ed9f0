"""What the CLI tests share: the `zattera` command against a real NATS server, and a look at the state it wrote."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from typer.testing import CliRunner, Result

from cli.main import app
from shared.connection import connect
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer

Invoke = Callable[..., Result]


def initialised_cli(nats_url: str) -> Invoke:
    """The CLI bound to ``nats_url`` after `zattera cluster init` (the CLI itself never provisions)."""
    runner = CliRunner()
    assert runner.invoke(app, ["--nats", nats_url, "cluster", "init"]).exit_code == 0

    def invoke(*args: str, input: str | bytes | None = None) -> Result:
        return runner.invoke(app, ["--nats", nats_url, *args], input=input, catch_exceptions=False)

    return invoke


def state(nats_url: str, fn: Callable[[Any, StateView, Writer], Any]) -> Any:
    """Runs ``fn(conn, view, writer)`` on a fresh connection and a loaded view, and returns what it returns."""

    async def go() -> Any:
        conn = await connect(nats_url, name="t")
        await provision(conn.js)
        view = StateView(conn, name="t")
        await view.start()
        try:
            return await fn(conn, view, Writer(conn, view))
        finally:
            await view.stop()
            await conn.close()

    return asyncio.run(go())
