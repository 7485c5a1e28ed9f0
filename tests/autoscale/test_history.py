"""The metrics-history loop on real NATS with a fake clock: points of envs, nodes and proxies stored every
10 s, read back as a series; a 5-min point once the clock crosses a bucket; deploy events become marks;
a point published again (a failover) is stored once."""

from __future__ import annotations

import asyncio
import contextlib

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.autoscale.history import HistoryRecorder
from shared import history as H
from shared import history_read as HR
from shared.events import EventPublisher, event_for_env
from shared.loop import LoopDeps
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import REL, base_objects, node_beat, proxy_beat, running, scaled_env
from tests.factories import assignment
from tests.waiting import eventually

BUCKET = 1_700_000_100.0  # a 5-min boundary


def traffic_sample(requests: int, errors: int = 0) -> cpb.ProxySample:
    return cpb.ProxySample(
        requests_total=requests,
        responses_2xx_total=requests - errors,
        responses_5xx_total=errors,
        latency_p50_ms=5,
        latency_p99_ms=40,
        rps=20.0,
    )


async def recorder(h: Harness) -> HistoryRecorder:
    loop = HistoryRecorder(LoopDeps(h.conn, h.view, h.clock), live=h.live)
    loop.on_term_start()
    await loop.begin_term()
    return loop


async def test_points_are_stored_every_slot_and_read_back_as_a_series(h: Harness) -> None:
    h.clock.set(BUCKET)
    await h.seed(*base_objects(scaled_env(min_replicas=2), running(2)))
    loop = await recorder(h)
    try:
        requests = 0
        for step in range(32):  # 320 s: a whole 5-min bucket and the slots either side
            now = h.clock.now()
            requests += 200  # 20 requests/s
            errors = 10 * step
            await h.beat(proxy_beat(now, envs={"env1": traffic_sample(requests, errors)}))
            await h.beat(node_beat(now, instances={"env1-a0": (25.0, 1000), "env1-a1": (15.0, 500)}))
            await loop.pass_once()
            h.clock.set(now + 10)
        raw = await HR.read_points(h.conn.nc, H.RAW, H.ENV, "env1", BUCKET - 10)
        # the term's first pass only reads the counters; then each point is of the slot that just ended
        assert len(raw) == 31 and raw[0].time == BUCKET
        steady = raw[5]
        assert abs(steady.rps - 20.0) < 0.01
        assert steady.responses_5xx == 10
        assert (steady.desired, steady.running) == (2, 0)  # the factory's assignments report no state
        assert steady.cpu_percent == 40.0 and steady.memory_bytes == 1500
        node = await HR.read_points(h.conn.nc, H.RAW, H.NODE, "n1", BUCKET)
        assert len(node) == 31 and node[0].instances == 2 and node[0].time == BUCKET
        down = await HR.read_points(h.conn.nc, H.DOWN, H.ENV, "env1", BUCKET)
        assert len(down) == 1 and down[0].samples == 30 and abs(down[0].rps - 20.0) < 0.01
        series = await HR.history(h.conn.nc, H.ENV, "env1", 600, h.clock.now())
        values = [v for v in series.values("rps") if v]
        assert len(values) >= 30 and all(abs(v - 20.0) < 0.01 for v in values)
        day = await HR.history(h.conn.nc, H.ENV, "env1", 86_400, h.clock.now())
        assert day.span == 300 and any(v and abs(v - 20.0) < 0.01 for v in day.values("rps"))
    finally:
        await loop.end_term()


async def test_deploy_events_become_marks_and_a_new_leader_keeps_the_previous_leaders_point(h: Harness) -> None:
    h.clock.set(BUCKET)
    await h.seed(*base_objects(scaled_env(min_replicas=1), running(1)))
    loop = await recorder(h)
    try:
        event = event_for_env(h.env(), "deploy.succeeded", "release v2 is live")
        await EventPublisher(h.conn).publish(event)
        marks: list[H.Mark] = []

        async def marked() -> bool:
            marks[:] = await HR.read_marks(h.conn.nc, "env1", BUCKET - 3600)
            return bool(marks)

        await eventually(marked, what="the deploy mark stored")
        assert marks[0].kind == "deploy.succeeded" and marks[0].text == "release v2 is live"
        await h.beat(proxy_beat(h.clock.now(), envs={"env1": traffic_sample(10)}))
        await loop.pass_once()  # primes the counters
        h.clock.set(BUCKET + 10)
        await h.beat(proxy_beat(h.clock.now(), envs={"env1": traffic_sample(210)}))
        await loop.pass_once()  # writes the slot BUCKET..+10
        h.clock.set(BUCKET + 14)  # the old leader dies; a new one starts within the next slot
        again = HistoryRecorder(LoopDeps(h.conn, h.view, h.clock), live=h.live)
        again.on_term_start()
        await again.begin_term()
        await again.pass_once()  # reads the counters, writes nothing
        await again.end_term()
        stored = await HR.read_points(h.conn.nc, H.RAW, H.ENV, "env1", BUCKET - 10)
        assert [p.time for p in stored] == [BUCKET] and abs(stored[0].rps - 20.0) < 0.01  # the good point kept
        assert len(H.dense(stored, int(BUCKET), int(BUCKET) + 10, 10)) == 1
    finally:
        await loop.end_term()


async def test_a_running_term_writes_one_point_per_slot_on_the_clock(h: Harness) -> None:
    """The loop as its service runs it (a term under its lease): a pass at each 10-s boundary of the injected
    clock, not on state changes; the metrics streams created at the term's start."""
    h.clock.set(BUCKET + 3)
    await h.seed(*base_objects(scaled_env(min_replicas=1), running(1)))
    loop = HistoryRecorder(LoopDeps(h.conn, h.view, h.clock, coalesce=0), live=h.live)
    term = asyncio.create_task(loop.run(await h.leadership(loop.name)))
    try:
        for step in range(4):
            await h.beat(proxy_beat(h.clock.now(), envs={"env1": traffic_sample(100 * (step + 1))}))
            await eventually(lambda: h.clock.sleepers > 0, what="the loop waits for its next slot")
            await h.edit_env(h.env())  # a state change: no pass of its own
            await h.clock.advance(10)
        points: list[cpb.MetricPoint] = []

        async def four() -> bool:
            points[:] = await HR.read_points(h.conn.nc, H.RAW, H.ENV, "env1", BUCKET - 10)
            return len(points) >= 4

        await eventually(four, what="a point per slot")
        assert [p.time for p in points] == [BUCKET + 10 * i for i in range(len(points))]
    finally:
        term.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await term


async def test_two_replicas_are_kept_per_replica_and_a_stopped_ones_series_ends(h: Harness) -> None:
    """Two replicas of an env on two nodes report their usage in their nodes' heartbeats; the loop keeps a
    series per replica (labelled by node and release version) beside the env's sums, downsampled at the 5-min
    boundary; the replica that stops has no point after it stopped."""
    h.clock.set(BUCKET)
    second = assignment("n2", "env1", REL, assignment_id="env1-a1")
    await h.seed(*base_objects(scaled_env(min_replicas=2), [*running(1), second]))
    loop = await recorder(h)
    try:
        for step in range(32):
            now = h.clock.now()
            await h.beat(node_beat(now, "n1", instances={"env1-a0": (20.0, 100 << 20)}))
            await h.beat(node_beat(now, "n2", instances={"env1-a1": (60.0, 300 << 20)} if step < 20 else {}))
            await loop.pass_once()
            h.clock.set(now + 10)
        raw = await HR.read_points(h.conn.nc, H.RAW, H.ENV, "env1", BUCKET - 10)
        assert len(raw) == 31
        assert [(r.id, r.node, r.version) for r in raw[0].replicas] == [("env1-a0", "n1", 1), ("env1-a1", "n2", 1)]
        assert [r.node for r in raw[1].replicas] == ["", ""]  # labels once, not in every point
        assert raw[0].cpu_percent == 80.0 and raw[0].memory_bytes == 400 << 20  # the sums as before
        assert [r.id for r in raw[30].replicas] == ["env1-a0"]
        down = await HR.read_points(h.conn.nc, H.DOWN, H.ENV, "env1", BUCKET)
        replicas = {r.id: r for r in down[0].replicas}
        assert replicas["env1-a1"].cpu_percent == 60.0 and replicas["env1-a1"].samples == 19
        assert replicas["env1-a0"].samples == 30 and replicas["env1-a0"].node == "n1"
        series = HR.replica_series(await HR.history(h.conn.nc, H.ENV, "env1", 600, h.clock.now()))
        by_label = {s.label: s for s in series}
        assert set(by_label) == {"env1-a0 v1 on n1", "env1-a1 v1 on n2"}
        stopped = by_label["env1-a1 v1 on n2"]
        known = [i for i, v in enumerate(stopped.cpu_percent) if v is not None]
        assert len(known) == 19 and known == list(range(known[0], known[0] + 19))  # one run, then it ends
        assert stopped.last_seen < by_label["env1-a0 v1 on n1"].last_seen
    finally:
        await loop.end_term()
