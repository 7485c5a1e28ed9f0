"""StateView resync against a replica still behind what the view showed: the load is thrown away and taken
again (never applied older than the view), on real NATS. The lag is made at the consumer's delivery: this
view's handler drops what the lagging replica would not have yet (every message at or above the view's
revision) in the generations the test names; ``test_view_lagging_replica.py`` has the real lagging follower."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.msg import Msg

from shared import keys as K
from shared.connection import Connection
from shared.state import feed
from shared.state.feed import StateView
from shared.txn import Writer
from tests.factories import env
from tests.waiting import eventually


class LaggingView(StateView):
    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, name="lagging")
        self.lagging: Callable[[int], bool] = lambda generation: False
        self.removed: list[str] = []

    def _on_message(self, generation: int, done: object) -> Callable[[Msg], Awaitable[None]]:
        deliver = super()._on_message(generation, done)  # type: ignore[arg-type]
        if not self.lagging(generation):
            return deliver
        floor = self._resync_floor

        async def behind(msg: Msg) -> None:
            if msg.metadata.sequence.stream < floor:  # what the replica has; the rest is still coming to it
                await deliver(msg)
            elif msg.metadata.num_pending == 0 and isinstance(done, asyncio.Future) and not done.done():
                done.set_result(None)  # the replica's load ends with what it has

        return behind

    def _notify(self, kind: str, ident: str) -> None:
        super()._notify(kind, ident)
        if kind == K.ENV and self.env(ident) is None:
            self.removed.append(ident)


@pytest.fixture
async def lagging(conn: Connection, writer: Writer, monkeypatch: pytest.MonkeyPatch) -> LaggingView:
    monkeypatch.setattr(feed, "LOAD_STALL", 0.3)
    await writer.commit(writer.txn().create(env("first")))
    await writer.commit(writer.txn().create(env("newest")))  # the view's newest revision
    view = LaggingView(conn)
    await view.start()
    await eventually(lambda: view.env("newest") is not None, 10)
    return view


async def test_a_load_below_the_views_revision_is_taken_again_not_applied(lagging: LaggingView) -> None:
    first = lagging._generation + 1
    lagging.lagging = lambda generation: generation == first
    try:
        await lagging.force_resync()
        assert lagging._generation > first  # the lagging load was thrown away, another one taken
        assert lagging.env("newest") is not None and lagging.removed == []  # never shown older than it was
    finally:
        await lagging.stop()


async def test_loads_that_stay_below_are_applied_after_the_bound(lagging: LaggingView) -> None:
    first = lagging._generation + 1
    lagging.lagging = lambda generation: True
    try:
        await lagging.force_resync()
        assert lagging._generation == first + feed.MAX_FLOOR_MISSES - 1  # every load lagged: the last applied
        assert lagging.removed == ["newest"]  # what that load lacked (nothing more was coming)
    finally:
        await lagging.stop()


async def test_a_stream_restored_below_the_views_revision_is_loaded_at_once(lagging: LaggingView) -> None:
    first = lagging._generation + 1
    lagging.seen_revision = 10**9  # the view saw revisions the stream no longer has (restored from a backup)
    try:
        await lagging.force_resync()
        assert lagging._generation == first
        assert lagging.env("newest") is not None
    finally:
        await lagging.stop()
