"""BuildDispatcher on real NATS with an in-test builder."""

from __future__ import annotations

import asyncio

from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.builds.planning import WAITING_KIND, WAITING_MESSAGE, BuildDispatcherConfig
from shared.actions.builds import CancelBuild, cancel_build
from shared.actions.context import ActionContext
from shared.buildlogs import END_HEADER, follow_build_log, read_build_log
from shared.clock import FakeClock
from shared.connection import Connection
from shared.state.feed import StateView
from shared.streams import build_logs_stream_config
from shared.subjects import BUILD_LOGS_STREAM, EVENTS_STREAM, build_log_subject
from shared.txn import Writer
from tests.builds import seed
from tests.builds.conftest import StartDispatcher, advance_until
from tests.builds.fake_builder import FakeBuilder, log_event, success
from tests.waiting import eventually

QUEUED = pb.BUILD_STATUS_QUEUED
RUNNING = pb.BUILD_STATUS_RUNNING
SUCCEEDED = pb.BUILD_STATUS_SUCCEEDED
FAILED = pb.BUILD_STATUS_FAILED
CANCELED = pb.BUILD_STATUS_CANCELED


def last_event_at(view: StateView, build_id: str) -> float:
    b = view.build(build_id)
    return b.last_event_at.seconds + b.last_event_at.nanos / 1e9 if b else 0.0


def status_is(view: StateView, build_id: str, status: int) -> bool:
    b = view.build(build_id)
    return b is not None and b.status == status


async def put(writer: Writer, *msgs: object) -> None:
    txn = writer.txn("seed")
    for m in msgs:
        txn.put(m)  # type: ignore[arg-type]
    await writer.commit(txn)


async def waiting_events(conn: Connection) -> list[pb.Event]:
    try:
        msg = await conn.js.get_last_msg(EVENTS_STREAM, f"zattera.events.{WAITING_KIND}")
    except NotFoundError:
        return []
    return [pb.Event.FromString(msg.data or b"")]


async def has_waiting_event(conn: Connection) -> bool:
    return bool(await waiting_events(conn))


async def has_log(conn: Connection, build_id: str) -> bool:
    return bool(await read_build_log(conn, build_id))


async def test_dispatch_succeeds_with_digest_pinned_ref_and_durable_log(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(
        conn, "builder-a", script=[log_event("step 1/2"), log_event("step 2/2"), *success("sha256:abc123")]
    ).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    dispatcher = await start_dispatcher(
        BuildDispatcherConfig(source_url_base="https://ctrl:8443/internal/blobs/", registry_addr="ctrl:5000")
    )

    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 5, "b1 SUCCEEDED")
    b1 = view.build("b1")
    assert b1 is not None
    assert b1.node_id == "builder-a"
    assert b1.image_ref == "ctrl:5000/proj1/app1@sha256:abc123"
    assert b1.image_digest == "sha256:abc123"
    assert builder.requests[0].source_url == "https://ctrl:8443/internal/blobs/sha256:deadbeef"
    assert builder.requests[0].push_image_ref == "ctrl:5000/proj1/app1:b1"
    assert builder.requests[0].build.status == RUNNING
    assert await dispatcher.build_log("b1") == ["step 1/2", "step 2/2"]


async def test_builder_silent_for_the_lost_timeout_fails_the_build_and_is_told_to_stop(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher(BuildDispatcherConfig(builder_lost_timeout=240.0))
    await eventually(lambda: builder.build_ids == ["b1"], 5, "request received")
    start = clock.now()
    await clock.advance(100.0)
    await builder.emit("b1", log_event("pulling buildkitd"))  # silence is measured from the last event
    await eventually(lambda: last_event_at(view, "b1") == start + 100.0, 5, "last event made durable")

    await clock.advance(239.0)
    assert status_is(view, "b1", RUNNING)
    await clock.advance(1.0)
    await advance_until(clock, lambda: status_is(view, "b1", FAILED), "b1 FAILED")
    b1 = view.build("b1")
    assert b1 is not None and b1.error == "builder lost"
    await eventually(lambda: builder.cancels == ["b1"], 5, "builder told to stop")


async def test_no_builder_leaves_build_queued_and_warns_once(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    await put(writer, seed.build("b1"))
    dispatcher = await start_dispatcher()
    await eventually(lambda: dispatcher.passes >= 1, 5, "a pass ran")
    await eventually(lambda: has_waiting_event(conn), 5, "waiting event")
    [event] = await waiting_events(conn)
    assert (event.severity, event.message) == ("warning", WAITING_MESSAGE)
    assert (event.environment_id, event.fields["build_id"]) == ("env1", "b1")
    assert status_is(view, "b1", QUEUED)


async def test_cordoned_builder_is_skipped_and_uncordon_dispatches_at_once(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", script=success()).start()
    await put(writer, seed.builder_node("builder-a", cordoned=True), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: has_waiting_event(conn), 5, "waiting event")
    assert status_is(view, "b1", QUEUED)
    assert builder.requests == []

    await put(writer, seed.builder_node("builder-a"))  # uncordon: a Node change triggers a pass, no tick needed
    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 5, "b1 SUCCEEDED")


async def test_success_replaces_requested_platforms_with_built_ones_for_deployment_gating(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    await FakeBuilder(conn, "builder-a", script=success("sha256:abc123", ["linux/arm64"])).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher(BuildDispatcherConfig(registry_addr="ctrl:5000"))
    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 5, "b1 SUCCEEDED")
    b1 = view.build("b1")
    assert b1 is not None
    assert (b1.image_ref, list(b1.platforms)) == ("ctrl:5000/proj1/app1@sha256:abc123", ["linux/arm64"])
    assert b1.finished_at.seconds > 0


async def test_builder_error_is_recorded_verbatim_for_deployment_gating(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    await FakeBuilder(conn, "builder-a", script=[cpb.BuildEvent(status=FAILED, error="compile error")]).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: status_is(view, "b1", FAILED), 5, "b1 FAILED")
    b1 = view.build("b1")
    assert b1 is not None and b1.error == "compile error"


async def test_unreachable_builder_fails_with_dispatch_error(
    view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: status_is(view, "b1", FAILED), 5, "b1 FAILED")
    b1 = view.build("b1")
    assert b1 is not None and b1.error.startswith("dispatch: ") and b1.node_id == "builder-a"


async def test_a_run_build_request_whose_reply_was_lost_is_sent_again_and_the_build_runs_once(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", script=success(), unanswered=2).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 10, "b1 SUCCEEDED")
    assert builder.received == 3 and builder.build_ids == ["b1"]


async def test_builder_refusing_the_request_fails_with_build_stream_error(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    await FakeBuilder(conn, "builder-a", refuse="no build server").start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: status_is(view, "b1", FAILED), 5, "b1 FAILED")
    b1 = view.build("b1")
    assert b1 is not None and b1.error == "build stream: no build server"


async def test_per_builder_cap_holds_builds_queued_and_a_freed_slot_dispatches_at_once(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"), seed.build("b2"), seed.build("b3"))
    await start_dispatcher(BuildDispatcherConfig(builder_concurrency=2))
    await eventually(lambda: builder.build_ids == ["b1", "b2"], 5, "two dispatched")
    assert status_is(view, "b3", QUEUED)
    assert await waiting_events(conn) == []  # busy is not "no builder"

    await builder.emit("b1", *success())
    await eventually(lambda: builder.build_ids == ["b1", "b2", "b3"], 5, "b3 dispatched when b1 freed a slot")
    assert status_is(view, "b1", SUCCEEDED)


async def test_builds_spread_to_the_least_loaded_builder_then_the_lowest_id(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    a = await FakeBuilder(conn, "builder-a", hold=True).start()
    b = await FakeBuilder(conn, "builder-b", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.builder_node("builder-b"))
    await put(writer, *(seed.build(f"b{i}") for i in range(1, 4)))
    await start_dispatcher()
    await eventually(lambda: len(a.requests) + len(b.requests) == 3, 5, "three dispatched")
    assert (a.build_ids, b.build_ids) == (["b1", "b3"], ["b2"])


async def test_platforms_no_builder_can_produce_wait_with_a_warning_naming_them(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    emulating = await FakeBuilder(conn, "builder-b", script=success()).start()
    await put(
        writer, seed.builder_node("builder-a", os_arch="linux/arm64"), seed.build("b1", platforms=["linux/amd64"])
    )
    await start_dispatcher()
    await eventually(lambda: has_waiting_event(conn), 5, "waiting event")
    [event] = await waiting_events(conn)
    assert "linux/amd64" in event.message

    await put(
        writer,
        seed.builder_node("builder-b", os_arch="linux/arm64", labels={"zattera.dev/build-platforms": "linux/amd64"}),
    )
    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 5, "b1 built by the emulating builder")
    assert emulating.build_ids == ["b1"]


async def test_operator_cancel_of_running_build_is_kept_and_the_builder_is_told_to_stop(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: builder.build_ids == ["b1"], 5, "request received")

    await cancel_build(ActionContext(conn, writer, "tester", clock), CancelBuild("b1"))
    await eventually(lambda: builder.cancels == ["b1"], 5, "builder told to stop")
    await builder.emit("b1", *success())  # a late success does not overwrite the cancel
    lines = [line async for line in follow_build_log(conn, "b1", idle_check=0.2)]
    assert lines == []
    assert status_is(view, "b1", CANCELED)


async def test_events_of_a_build_sent_by_another_builder_are_ignored(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    """A build's events count only from the node it was assigned to (the subject's last token, which a
    secured builder cannot forge: tests/security/test_build_events.py)."""
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    forger = await FakeBuilder(conn, "builder-b", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: builder.build_ids == ["b1"], 5, "request received")

    await forger.emit("b1", log_event("forged"), cpb.BuildEvent(status=FAILED, error="forged", done=True))
    await builder.emit("b1", log_event("real"), *success())
    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 5, "b1 SUCCEEDED from its own builder")
    assert await read_build_log(conn, "b1") == ["real"]


async def test_canceled_queued_build_is_never_dispatched(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", script=success()).start()
    await put(writer, seed.build("b1"), seed.build("b2"))
    await cancel_build(ActionContext(conn, writer, "tester", clock), CancelBuild("b1"))
    await start_dispatcher()
    await put(writer, seed.builder_node("builder-a"))
    await eventually(lambda: status_is(view, "b2", SUCCEEDED), 5, "b2 SUCCEEDED")
    assert builder.build_ids == ["b2"] and status_is(view, "b1", CANCELED)


async def test_follow_streams_lines_as_they_come_until_the_build_ends(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: builder.build_ids == ["b1"], 5, "request received")
    seen: list[str] = []

    async def follow() -> None:
        async for line in follow_build_log(conn, "b1", idle_check=5.0):
            seen.append(line)

    follower = asyncio.create_task(follow())
    await builder.emit("b1", log_event("one"))
    await eventually(lambda: seen == ["one"], 5, "first line followed")
    await builder.emit("b1", log_event("two"), *success())
    await asyncio.wait_for(follower, 5)  # ends at the dispatcher's end marker, not at the idle check
    assert seen == ["one", "two"]


async def test_log_keeps_the_newest_lines_up_to_the_per_build_cap(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    await conn.js.update_stream(build_logs_stream_config(1, lines_per_build=5))  # a test-only cap
    lines = [f"line {i}" for i in range(8)]
    await FakeBuilder(conn, "builder-a", script=[*(log_event(x) for x in lines), *success()]).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: status_is(view, "b1", SUCCEEDED), 5, "b1 SUCCEEDED")
    await eventually(lambda: log_ended(conn, "b1"), 5, "end marker appended")
    assert await read_build_log(conn, "b1") == lines[-5:]  # the cap counts lines; the marker has its own slot
    assert await stored_log_messages(conn, "b1") == 5 + 1


async def test_a_running_builds_log_shows_at_most_the_cap(
    conn: Connection, view: StateView, writer: Writer, start_dispatcher: StartDispatcher
) -> None:
    # Until the end marker lands, its reserved slot holds one line more than the cap: readers leave it out.
    await conn.js.update_stream(build_logs_stream_config(1, lines_per_build=5))  # a test-only cap
    lines = [f"line {i}" for i in range(8)]
    builder = await FakeBuilder(conn, "builder-a", hold=True).start()
    await put(writer, seed.builder_node("builder-a"), seed.build("b1"))
    await start_dispatcher()
    await eventually(lambda: builder.build_ids == ["b1"], 5, "request received")
    await builder.emit("b1", *(log_event(x) for x in lines))
    await eventually(lambda: last_stored_line_is(conn, "b1", "line 7"), 5, "every line copied")
    assert await stored_log_messages(conn, "b1") == 5 + 1  # the marker's slot holds one more line meanwhile
    assert await read_build_log(conn, "b1") == lines[-5:]
    seen: list[str] = []

    async def follow() -> None:
        async for line in follow_build_log(conn, "b1", idle_check=5.0):
            seen.append(line)

    follower = asyncio.create_task(follow())
    await eventually(lambda: seen == lines[-5:], 5, "backlog followed, trimmed to the cap")
    await builder.emit("b1", log_event("last"), *success())
    await asyncio.wait_for(follower, 5)
    assert seen == [*lines[-5:], "last"]
    assert await read_build_log(conn, "b1") == [*lines[-4:], "last"]


async def log_ended(conn: Connection, build_id: str) -> bool:
    try:
        msg = await conn.js.get_last_msg(BUILD_LOGS_STREAM, build_log_subject(build_id))
    except NotFoundError:
        return False
    return END_HEADER in (msg.headers or {})


async def stored_log_messages(conn: Connection, build_id: str) -> int:
    subject = build_log_subject(build_id)
    info = await conn.js.stream_info(BUILD_LOGS_STREAM, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def last_stored_line_is(conn: Connection, build_id: str, line: str) -> bool:
    try:
        msg = await conn.js.get_last_msg(BUILD_LOGS_STREAM, build_log_subject(build_id))
    except NotFoundError:
        return False
    return msg.data == line.encode()
