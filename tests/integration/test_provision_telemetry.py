"""Provisioning is idempotent; trace context travels in the headers of state writes."""

from __future__ import annotations

import asyncio

from zattera.v1 import types_pb2 as pb

from shared import telemetry
from shared.connection import connect
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.subjects import IMAGES_STORE, LIVE_STREAM, SNAPSHOTS_STORE, SOURCES_STORE, STATE_PREFIX, STATE_STREAM
from shared.txn import Writer


async def test_provisioning_twice_and_concurrently_is_harmless(nats_url):
    conns = [await connect(nats_url, name=f"p{i}") for i in range(3)]
    await asyncio.gather(*(provision(c.js) for c in conns))
    await provision(conns[0].js)
    info = await conns[0].js.stream_info(STATE_STREAM)
    assert info.config.allow_atomic and info.config.allow_msg_ttl
    assert info.config.max_msgs_per_subject == 1
    live = await conns[0].js.stream_info(LIVE_STREAM)
    assert live.config.max_age == 60
    for bucket in (SOURCES_STORE, IMAGES_STORE, SNAPSHOTS_STORE):
        await conns[0].js.object_store(bucket)
    for c in conns:
        await c.close()


async def test_state_writes_carry_the_current_trace_context(conn, view: StateView):
    exporter = telemetry.use_in_memory_exporter()
    writer = Writer(conn, view)
    node = pb.Node(name="traced")
    node.meta.id = "n1"
    with telemetry.span("deploy.test") as current:
        trace_id = format(current.get_span_context().trace_id, "032x")
        await writer.commit(writer.txn().create(node))
    raw = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + "node.n1", direct=True)
    assert trace_id in raw.headers["traceparent"]
    names = {s.name for s in exporter.get_finished_spans()}
    assert {"deploy.test", "state.write"} <= names


async def test_views_keep_the_trace_of_each_write_and_loops_continue_it(conn, view: StateView):
    """A service reacting to a write continues its trace: the view keeps each key's ``traceparent`` (from the
    watch, and for its own writes from what it sent), and a loop pass woken by the write is its child."""
    from shared import keys as K
    from shared.loop import LeaderLoop, LoopDeps

    exporter = telemetry.use_in_memory_exporter()
    writer = Writer(conn, view)
    other = StateView(conn, name="other")
    await other.start()
    try:
        node = pb.Node(name="traced")
        node.meta.id = "n2"
        with telemetry.span("cli.deploy") as current:
            trace_id = format(current.get_span_context().trace_id, "032x")
            await writer.commit(writer.txn().create(node))
        key = K.node("n2")
        assert trace_id in view.trace_headers(key)["traceparent"]  # own write (read-your-writes)
        for _ in range(200):
            if other.trace_headers(key):
                break
            await asyncio.sleep(0.01)
        assert trace_id in other.trace_headers(key)["traceparent"]  # seen through the watch

        untraced = pb.Node()
        untraced.CopyFrom(node)
        untraced.name = "renamed"
        await writer.commit(writer.txn().put(untraced))  # no span: the key's trace is gone with its revision
        assert view.trace_headers(key) == {}

        class Probe(LeaderLoop):
            name = "probe"

            async def run_pass(self) -> None:
                return None

        with telemetry.span("cli.deploy.again"):
            await writer.commit(writer.txn().put(node))
        probe = Probe(LoopDeps(conn, view, None))  # type: ignore[arg-type]
        parent = probe.trigger_trace({(K.NODE, "n2")})
        await probe.pass_once({(K.NODE, "n2")})
        passes = [s for s in exporter.get_finished_spans() if s.name == "probe.pass"]
        assert parent and passes
        assert format(passes[-1].context.trace_id, "032x") in parent["traceparent"]
    finally:
        await other.stop()
