"""Pure tests of the per-replica history (issue 40, "CPU and memory summed and per replica"): entries added to
the env points from the node heartbeats, labels written sparingly, downsampling under a fake clock (a replica
that stopped is not diluted), the series a reader builds (a stopped replica's series ends) and the cap on
lines."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared import history as H
from shared import history_read as HR
from shared.clock import FakeClock
from tests.autoscale.helpers import node_beat

BUCKET = 1_700_000_100.0  # a 5-min boundary
A1 = "01JD5Q8ZKX3V7W9YB2CAAAAAA1"
A2 = "01JD5Q8ZKX3V7W9YB2CBBBBBB2"
ENV = H.subject(H.RAW, H.ENV, "e1")


def one_pass(
    rec: H.Recorder, replicas: H.ReplicaRecorder, at: float, instances: dict[str, dict[str, tuple[float, int]]]
) -> dict[str, cpb.MetricPoint]:
    """A pass at ``at``: ``instances`` maps node id → assignment id → (cpu, memory)."""
    beats = {node: node_beat(at, node, instances=usage) for node, usage in instances.items()}
    env_of = {aid: "e1" for usage in instances.values() for aid in usage}
    points = rec.points(at, beats, [], {"e1": H.EnvFacts(2, 2)}, env_of)
    replicas.add(points, beats, env_of, {A1: 3, A2: 4})
    return points


def test_each_replica_gets_an_entry_with_labels_in_its_first_point_and_each_bucket_start() -> None:
    rec, replicas = H.Recorder(), H.ReplicaRecorder()
    usage = {"n1": {A1: (30.0, 100 << 20)}, "n2": {A2: (10.0, 50 << 20)}}
    first = one_pass(rec, replicas, BUCKET + 20, usage)[ENV]  # the slot BUCKET+10
    assert [(r.id, r.node, r.version) for r in first.replicas] == [("CAAAAAA1", "n1", 3), ("CBBBBBB2", "n2", 4)]
    assert first.cpu_percent == pytest.approx(40.0) and first.memory_bytes == 150 << 20  # the sums stay
    assert first.replicas[0].cpu_percent == pytest.approx(30.0) and first.replicas[1].memory_bytes == 50 << 20
    second = one_pass(rec, replicas, BUCKET + 30, usage)[ENV]
    assert [(r.node, r.version) for r in second.replicas] == [("", 0), ("", 0)]  # labelled already
    at_bucket = one_pass(rec, replicas, BUCKET + 310, usage)[ENV]  # the slot that starts the next bucket
    assert at_bucket.time % H.DOWN_SPAN == 0 and all(r.node and r.version for r in at_bucket.replicas)
    assert H.replica_id("short-a0") == "short-a0" and H.replica_id(A1) == "CAAAAAA1"


def test_downsampling_per_replica_with_a_fake_clock_keeps_a_stopped_replica_undiluted() -> None:
    clock = FakeClock(BUCKET + 10)
    rec, replicas, down = H.Recorder(), H.ReplicaRecorder(), H.Downsampler()
    emitted: dict[str, cpb.MetricPoint] = {}
    for step in range(31):  # the slots BUCKET … BUCKET+300: one whole bucket, then the next bucket's first
        now = clock.now()
        usage: dict[str, dict[str, tuple[float, int]]] = {"n1": {A1: (20.0 + step % 2 * 20, (100 + step) << 20)}}
        if step < 10:  # A2 runs the first 100 s of the bucket, then stops
            usage["n2"] = {A2: (50.0, 70 << 20)}
        points = one_pass(rec, replicas, now, usage)
        emitted.update(down.add(points, now - H.RAW_SPAN))
        clock.set(now + H.RAW_SPAN)
    point = emitted[H.subject(H.DOWN, H.ENV, "e1")]
    assert point.time == BUCKET and point.samples == 30
    by_id = {r.id: r for r in point.replicas}
    assert set(by_id) == {"CAAAAAA1", "CBBBBBB2"}
    a1, a2 = by_id["CAAAAAA1"], by_id["CBBBBBB2"]
    assert a1.cpu_percent == pytest.approx(30.0) and a1.samples == 30 and a1.memory_bytes == 129 << 20
    assert a2.cpu_percent == pytest.approx(50.0) and a2.samples == 10  # its mean while it ran, not over 5 min
    assert (a1.node, a1.version, a2.node, a2.version) == ("n1", 3, "n2", 4)  # every 5-min point is labelled
    # the env's sum is averaged over the whole span as before: A2's 10 points of 50 % add 500/30
    assert point.cpu_percent == pytest.approx(30.0 + 500 / 30)
    # regrouped into 30 min (a 7-day chart), the replica's mean is weighted by its samples
    later = cpb.MetricPoint(time=int(BUCKET) + 300, span=300, samples=30)
    later.replicas.add(id="CAAAAAA1", cpu_percent=60.0, memory_bytes=1, samples=30)
    grouped = H.regroup([point, later], 1800)
    merged = {r.id: r for r in grouped[0].replicas}
    assert merged["CAAAAAA1"].cpu_percent == pytest.approx(45.0) and merged["CAAAAAA1"].samples == 60
    assert merged["CBBBBBB2"].cpu_percent == pytest.approx(50.0)


def test_a_stopped_replicas_series_ends_and_labels_come_from_any_point() -> None:
    slots: list[tuple[int, cpb.MetricPoint | None]] = []
    for i in range(6):
        point = cpb.MetricPoint(time=int(BUCKET) + 10 * i, span=10)
        point.replicas.add(id="CAAAAAA1", cpu_percent=10.0 * i, memory_bytes=1000, node="n1" if i == 3 else "")
        if i < 2:
            point.replicas.add(id="CBBBBBB2", cpu_percent=5.0, memory_bytes=2000, node="n2", version=7)
        slots.append((point.time, point))
    slots.append((int(BUCKET) + 60, None))
    history = HR.History(H.ENV, "e1", int(BUCKET), int(BUCKET) + 70, 10, slots, [])
    a1, a2 = HR.replica_series(history)
    assert a1.label == "…CAAAAAA1 on n1" and a1.cpu_percent[:6] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert a2.label == "…CBBBBBB2 v7 on n2" and a2.memory_bytes == [2000.0, 2000.0, None, None, None, None, None]
    assert (a1.last_seen, a2.last_seen) == (5, 1)
    as_json = HR.replicas_as_dict(history)
    assert as_json["replicas"][1]["memory_bytes"][:3] == [2000, 2000, None] and as_json["replicas_left_out"] == 0


def test_lines_are_capped_keeping_the_replicas_that_still_run() -> None:
    n = 12
    series = [
        HR.ReplicaSeries(
            f"r{i:02d}", "n1", 1, [float(i)] * (i + 1) + [None] * (n - i - 1), [1.0] * (i + 1) + [None] * (n - i - 1)
        )
        for i in range(n)
    ]
    shown, left_out = HR.pick_replicas(series, 8)
    assert left_out == 4 and [s.id for s in shown] == [f"r{i:02d}" for i in range(4, 12)]
    assert HR.pick_replicas(series[:3], 8) == (series[:3], 0)
