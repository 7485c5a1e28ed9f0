"""The CLI's connection to the control plane: NATS, a state view and an unfenced writer.

The CLI writes through the same fenced-write layer as the services (every write expects the revision
it was decided on); it never holds a lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import typer
from rich.console import Console

from shared.natsio import Connection, connect, provision
from shared.settings import settings
from shared.txn import Writer
from shared.view import StateView

T = TypeVar("T")

err = Console(stderr=True, soft_wrap=True)  # messages are never cut at 80 columns in a pipe


@dataclass
class Control:
    conn: Connection
    view: StateView
    writer: Writer


@dataclass
class Options:
    nats_url: str = ""
    json: bool = False
    wide: bool = False


OPTIONS = Options()


def nats_url() -> str:
    return OPTIONS.nats_url or settings().nats_url


@asynccontextmanager
async def control(*, view: bool = True) -> AsyncIterator[Control]:
    url = nats_url()
    try:
        cfg = settings()
        conn = await connect(
            url, name="zattera-cli", connect_timeout=3, creds=cfg.nats_creds or None, tls_ca=cfg.nats_tls_ca or None
        )
    except (ConnectionError, OSError) as exc:
        err.print(
            f"[red]error:[/] cannot reach NATS at {url}: {exc}. Is the cluster up (`make up`)?",
            markup=True,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(2) from exc
    state = StateView(conn, name="cli")
    try:
        if not cfg.nats_creds:
            # An unsecured cluster may not be provisioned yet (the CLI ran before any service); an operator
            # credential on a secured one may not create streams, and the services have done it anyway.
            await provision(conn.js, replicas=cfg.replicas, live_ttl=cfg.live_ttl, tombstone_ttl=cfg.tombstone_ttl)
        if view:
            await state.start(timeout=30)
        yield Control(conn, state, Writer(conn, state))
    finally:
        await state.stop()
        await conn.close()


def run(fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return asyncio.run(fn())  # type: ignore[arg-type]
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
