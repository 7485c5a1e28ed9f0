"""Fixtures for the builds tests: a fake clock and loops running under their real leases."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.builds.dispatcher import BuildDispatcher
from services.builds.planning import BuildDispatcherConfig
from shared.clock import FakeClock
from shared.connection import Connection
from shared.lease import run_while_leading
from shared.loop import LeaderLoop, LoopDeps
from shared.state.feed import StateView
from tests.waiting import eventually

StartDispatcher = Callable[..., Awaitable[BuildDispatcher]]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def leading() -> AsyncIterator[Callable[[Connection, LeaderLoop, str], asyncio.Task[None]]]:
    """Run a loop under its lease (``lease.<loop.name>``); every loop is stopped at the end of the test."""
    tasks: list[asyncio.Task[None]] = []

    def start(conn: Connection, loop: LeaderLoop, holder: str) -> asyncio.Task[None]:
        task = asyncio.create_task(
            run_while_leading(conn, loop.name, loop.run, holder=holder, ttl=1.0, renew_interval=0.2)
        )
        tasks.append(task)
        return task

    yield start
    for task in tasks:
        await stop(task)


async def stop(task: asyncio.Task[None]) -> None:
    """Cancel until done: LeaderLoop.run can swallow one cancel that lands while it wakes from its wait
    (``suppress(CancelledError)`` around awaiting its own cancelled sleeper, shared/loop.py)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.2)
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture
def start_dispatcher(
    conn: Connection, view: StateView, clock: FakeClock, leading: Callable[..., asyncio.Task[None]]
) -> StartDispatcher:
    async def start(
        config: BuildDispatcherConfig | None = None,
        *,
        conn: Connection = conn,
        view: StateView = view,
        tick: float = 15.0,
    ) -> BuildDispatcher:
        deps = LoopDeps(conn, view, clock, coalesce=0.0)
        dispatcher = BuildDispatcher(deps, config=config, tick=tick)
        leading(deps.conn, dispatcher, f"dispatcher-{id(dispatcher)}")
        return dispatcher

    return start


async def advance_until(clock: FakeClock, cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Wait for ``cond`` while nudging the fake clock forward a second per poll: a loop computes how long to
    sleep before its sleeper registers, so when the test advanced time in between, the sleeper's deadline
    lands up to one tick later than meant (the exact boundary is pinned by the pure tests)."""

    async def nudged() -> bool:
        await clock.advance(1.0)
        return cond()

    await eventually(nudged, timeout, what)
