"""Dispatcher failover on real NATS: a new leader resumes RUNNING builds from the durable events and
``Build.last_event_at``; no build is dispatched twice and none stays RUNNING forever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from zattera.v1 import types_pb2 as pb

from services.builds.dispatcher import BuildDispatcher
from shared.buildlogs import read_build_log
from shared.clock import FakeClock
from shared.connection import Connection, connect
from shared.state.feed import StateView
from shared.subjects import BUILD_EVENTS_STREAM, build_events_subject
from shared.txn import Writer
from tests.builds import seed
from tests.builds.conftest import StartDispatcher, advance_until, stop
from tests.builds.fake_builder import FakeBuilder, log_event, success
from tests.builds.test_dispatcher import put, status_is
from tests.waiting import eventually


@pytest.fixture
async def other_view(nats_url: str) -> AsyncIterator[tuple[Connection, StateView]]:
    """A second dispatcher process: its own connection and view."""
    conn = await connect(nats_url, name="dispatcher-b")
    view = StateView(conn, name="dispatcher-b")
    await view.start()
    yield conn, view
    await view.stop()
    await conn.close()


def current_task_of(dispatcher: BuildDispatcher) -> asyncio.Task[None]:
    [task] = [t for t in asyncio.all_tasks() if t.get_name() == "leader:builds"]
    return task


async def test_new_leader_resumes_a_running_build_without_losing_events_or_log_lines(
    conn: Connection,
    view: StateView,
    writer: Writer,
    start_dispatcher: StartDispatcher,
    other_view: tuple[Connection, StateView],
) -> None:
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    first = await start_dispatcher()
    await eventually(lambda: builder.build_ids == ["b1"], 5, "dispatched by the first leader")
    await builder.emit("b1", log_event("one"), log_event("two"))
    await eventually(lambda: has_lines(conn, "b1", 2), 5, "first leader copied two lines")

    await stop(current_task_of(first))  # the first leader goes away mid-build
    await builder.emit("b1", log_event("three"))  # nobody leads: the event waits in the stream

    conn_b, view_b = other_view
    await start_dispatcher(conn=conn_b, view=view_b)
    await builder.emit("b1", *success("sha256:abc123"))
    await eventually(lambda: status_is(view, "b1", pb.BUILD_STATUS_SUCCEEDED), 5, "second leader recorded success")
    assert await read_build_log(conn, "b1") == ["one", "two", "three"]
    assert builder.build_ids == ["b1"]  # never dispatched twice


async def has_lines(conn: Connection, build_id: str, n: int) -> bool:
    return len(await read_build_log(conn, build_id)) >= n


async def test_new_leader_fails_a_zombie_running_build_after_the_timeout_from_its_last_event(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    last_event = clock.now() - 100.0  # a previous leader saw the builder's last event 100 s ago
    await put(
        writer,
        seed.builder_node("builder-a"),
        seed.build("b1", status=pb.BUILD_STATUS_RUNNING, node_id="builder-a", last_event_at=last_event),
    )
    await start_dispatcher()
    await clock.advance(139.0)
    assert status_is(view, "b1", pb.BUILD_STATUS_RUNNING)
    await clock.advance(1.0)
    await advance_until(clock, lambda: status_is(view, "b1", pb.BUILD_STATUS_FAILED), "zombie failed")
    b1 = view.build("b1")
    assert b1 is not None and b1.error == "builder lost"
    await eventually(lambda: builder.cancels == ["b1"], 5, "builder told to stop")
    assert builder.requests == []  # resumed, not re-dispatched


async def test_new_leader_times_out_from_the_replayed_events_stream_time_not_the_older_checkpoint(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, start_dispatcher: StartDispatcher
) -> None:
    # Build.last_event_at is only checkpointed every 15 s; the builder's last event (stored in the events
    # stream while no dispatcher led) is 14 s newer. The new leader must time out from that event.
    lost_after = 240.0
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await builder.emit("b1", log_event("still working"))
    stored = await conn.js.get_last_msg(BUILD_EVENTS_STREAM, build_events_subject("b1", "builder-a"))
    assert stored.time is not None
    event_at = stored.time.timestamp()  # the server's wall clock, as in the replayed message's metadata
    clock.set(event_at + 1.0)  # the new leader takes over a second after that event
    checkpoint = event_at - 14.0
    await put(
        writer,
        seed.builder_node("builder-a"),
        seed.build("b1", status=pb.BUILD_STATUS_RUNNING, node_id="builder-a", last_event_at=checkpoint),
    )
    # A tick longer than the timeout: between passes the loop sleeps exactly until its own next deadline.
    dispatcher = await start_dispatcher(tick=10 * lost_after)
    await eventually(lambda: has_lines(conn, "b1", 1), 5, "the replayed event was handled")
    await eventually(lambda: clock.sleepers > 0, 5, "the dispatcher waits for its next deadline")

    def deadline_from_the_event() -> bool:
        due = dispatcher.seconds_until_due()
        return due is not None and clock.now() + due == pytest.approx(event_at + lost_after, abs=1e-3)

    await clock.advance(checkpoint + lost_after + 1.0 - clock.now())  # past the checkpoint's deadline
    await eventually(
        lambda: not status_is(view, "b1", pb.BUILD_STATUS_RUNNING) or deadline_from_the_event(),
        5,
        "a pass after the checkpoint's deadline",
    )
    assert status_is(view, "b1", pb.BUILD_STATUS_RUNNING), "timed out from the checkpoint, not the last event"

    await clock.advance(event_at + lost_after - clock.now())
    await advance_until(clock, lambda: status_is(view, "b1", pb.BUILD_STATUS_FAILED), "lost from the last event")
    b1 = view.build("b1")
    assert b1 is not None and b1.error == "builder lost"
    await eventually(lambda: builder.cancels == ["b1"], 5, "builder told to stop")
    assert builder.requests == []


async def test_contending_dispatchers_dispatch_every_build_exactly_once(
    conn: Connection,
    view: StateView,
    writer: Writer,
    start_dispatcher: StartDispatcher,
    other_view: tuple[Connection, StateView],
) -> None:
    builders = [await FakeBuilder(conn, f"builder-{i}", script=success()).start() for i in range(3)]
    await put(writer, *(seed.builder_node(b.node_id) for b in builders))
    conn_b, view_b = other_view
    await start_dispatcher()
    await start_dispatcher(conn=conn_b, view=view_b)
    await put(writer, *(seed.build(f"b{i:02d}") for i in range(12)))
    await eventually(
        lambda: all(status_is(view, f"b{i:02d}", pb.BUILD_STATUS_SUCCEEDED) for i in range(12)), 10, "all built"
    )
    dispatched = sorted(bid for b in builders for bid in b.build_ids)
    assert dispatched == [f"b{i:02d}" for i in range(12)]


async def test_a_build_claimed_moments_ago_by_a_deposed_leader_is_sent_again_and_runs_once(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, start_dispatcher: StartDispatcher
) -> None:
    # The previous leader's claim landed (its reply lost with a NATS server) and it was deposed before
    # sending the RunBuild: the builder never heard of b1.
    builder = await FakeBuilder(conn, "builder-a", script=success()).start()
    await put(
        writer,
        seed.builder_node("builder-a"),
        seed.build("b1", status=pb.BUILD_STATUS_RUNNING, node_id="builder-a", last_event_at=clock.now() - 2.0),
    )
    await start_dispatcher()
    await eventually(lambda: status_is(view, "b1", pb.BUILD_STATUS_SUCCEEDED), 10, "b1 SUCCEEDED")
    assert builder.build_ids == ["b1"]
