"""SnapshotDispatcher ↔ node agent over real NATS: records, failures, pre-hook, exclusivity, the
prune/snapshot race, restore guards, and the scheduler end to end."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.chunking import TEST_PARAMS
from services.agent.snapshots.engine import SnapshotEngine
from services.agent.snapshots.handlers import SnapshotAgent
from services.agent.snapshots.tarstream import tar_bytes
from services.scheduler.snapshots import SnapshotScheduler
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.snapshots.dispatch import SnapshotDispatcher
from shared.snapshots.guards import RestoreRefused, SnapshotBusy, SnapshotKeyMismatch, key_fingerprint
from shared.snapshots.store import SnapshotStore
from shared.state.feed import StateView
from shared.txn import Writer
from tests import factories
from tests.snapshots.conftest import BASE, snap_volume, snapshot_record, stamp, write_tree
from tests.waiting import eventually


@pytest.fixture
def dispatcher(conn: Connection, view: StateView, clock: FakeClock) -> SnapshotDispatcher:
    return SnapshotDispatcher(conn, view, clock, first_reply_timeout=2.0, idle_timeout=5.0)


async def add_volume(writer: Writer, agent: SnapshotAgent, volume: pb.Volume, files: dict[str, bytes]) -> Path:
    await writer.commit(writer.txn().put(factories.node(volume.node_id)).put(volume))
    root = agent.volumes_root / volume.meta.id
    write_tree(root, files)
    return root


async def test_snapshot_records_complete_with_sizes(dispatcher, agent, writer, view) -> None:
    volume = snap_volume("vol1")
    root = await add_volume(writer, agent, volume, {"a.bin": random.randbytes(100 << 10)})
    first = await dispatcher.snapshot(volume, writer)
    assert first.status == pb.SNAPSHOT_STATUS_COMPLETE, first.error
    assert first.manifest_key == first.meta.id
    assert first.logical_size_bytes == len(tar_bytes(root)) == first.uploaded_bytes
    again = await dispatcher.snapshot(volume, writer)
    assert again.status == pb.SNAPSHOT_STATUS_COMPLETE and again.uploaded_bytes == 0  # all deduplicated
    assert view.snapshot(again.meta.id) == again


async def test_missing_node_fails_with_a_record(dispatcher, agent, writer, view) -> None:
    """The reference failed before any record existed; here the FAILED record moves the baseline."""
    volume = snap_volume("vol1", node_id="n9")
    await writer.commit(writer.txn().put(volume))
    record = await dispatcher.snapshot(volume, writer)
    assert record.status == pb.SNAPSHOT_STATUS_FAILED and record.error == "volume node n9 not found"
    assert view.snapshot(record.meta.id) is not None


async def test_node_without_agent_fails_fast(dispatcher, writer) -> None:
    volume = snap_volume("vol1", node_id="n2")
    await writer.commit(writer.txn().put(factories.node("n2")).put(volume))
    record = await dispatcher.snapshot(volume, writer)
    assert record.status == pb.SNAPSHOT_STATUS_FAILED and "no agent answering" in record.error


async def test_pre_hook_runs_before_the_snapshot(dispatcher, agent, writer, conn, tmp_path) -> None:
    """The reference never ran the pre-hook."""
    volume = snap_volume("vol1")
    volume.snapshot_policy.pre_hook = 'printf "$ZATTERA_ASSIGNMENT_ID" > flushed'
    volume.lease.assignment_id = "asg1"
    await add_volume(writer, agent, volume, {"db": b"rows"})
    record = await dispatcher.snapshot(volume, writer)
    assert record.status == pb.SNAPSHOT_STATUS_COMPLETE, record.error
    engine = SnapshotEngine(await SnapshotStore.open(conn.js), params=TEST_PARAMS)
    await engine.restore(record.meta.id, tmp_path / "out")
    assert (tmp_path / "out" / "flushed").read_text() == "asg1"  # the hook's output is in the snapshot


async def test_failing_pre_hook_fails_the_snapshot(dispatcher, agent, writer) -> None:
    volume = snap_volume("vol1")
    volume.snapshot_policy.pre_hook = "exit 3"
    await add_volume(writer, agent, volume, {"db": b"rows"})
    record = await dispatcher.snapshot(volume, writer)
    assert record.status == pb.SNAPSHOT_STATUS_FAILED and record.error == "pre-hook exited 3"


async def test_one_snapshot_per_volume_at_a_time(dispatcher, agent, writer) -> None:
    volume = snap_volume("vol1")
    await add_volume(writer, agent, volume, {"a": random.randbytes(64 << 10)})
    running = await dispatcher.start_snapshot(volume, writer)
    with pytest.raises(SnapshotBusy):
        await dispatcher.start_snapshot(volume, writer)
    assert (await running).status == pb.SNAPSHOT_STATUS_COMPLETE
    assert (await dispatcher.snapshot(volume, writer)).status == pb.SNAPSHOT_STATUS_COMPLETE


async def test_snapshot_racing_a_prune_restores_byte_for_byte(conn, view, writer, clock, tmp_path) -> None:
    """The new snapshot deduplicates every chunk against s1 while a prune collects s1 (no grace)."""
    agent = SnapshotAgent(conn, "n1", tmp_path / "volumes", params=TEST_PARAMS, gc_grace=0)
    await agent.start()
    try:
        dispatcher = SnapshotDispatcher(conn, view, clock)
        volume = snap_volume("vol1")
        root = await add_volume(writer, agent, volume, {f"f{i}": random.randbytes(96 << 10) for i in range(4)})
        expected = tar_bytes(root)
        s1 = await dispatcher.snapshot(volume, writer)
        await writer.commit(writer.txn().delete(f"snapshot.{s1.meta.id}"))  # retention dropped s1
        snapshot = await dispatcher.start_snapshot(volume, writer)
        prune = asyncio.create_task(dispatcher.prune(volume, [s1.meta.id]))
        s2, pruned = await asyncio.gather(snapshot, prune)
        assert s2.status == pb.SNAPSHOT_STATUS_COMPLETE and pruned.error == ""
        engine = SnapshotEngine(await SnapshotStore.open(conn.js), params=TEST_PARAMS)
        assert not await engine.store.exists(engine.store.manifest_name(s1.meta.id))
        await engine.restore(s2.meta.id, tmp_path / "restored")
        assert tar_bytes(tmp_path / "restored") == expected
    finally:
        await agent.stop()


async def test_prune_defers_while_another_process_snapshot_runs(dispatcher, agent, writer) -> None:
    volume = snap_volume("vol1")
    await add_volume(writer, agent, volume, {"a": b"x"})
    foreign = pb.VolumeSnapshot(volume_id="vol2", status=pb.SNAPSHOT_STATUS_RUNNING)
    foreign.meta.id = "01FOREIGN"
    await writer.commit(writer.txn().put(foreign))
    response = await dispatcher.prune(volume, [])
    assert response.error.startswith("deferred")


async def test_restore_refused_while_mounted_then_rebuilds(dispatcher, agent, writer, view, clock) -> None:
    volume = snap_volume("vol1")
    root = await add_volume(writer, agent, volume, {"data": b"v1", "sub/x": b"x"})
    snapshot = await dispatcher.snapshot(volume, writer)
    expected = tar_bytes(root)
    write_tree(root, {"data": b"v2", "stray": b"new"})

    leased = pb.Volume()
    leased.CopyFrom(view.volume("vol1"))
    leased.lease.node_id, leased.lease.assignment_id = "n1", "a1"
    leased.lease.expires_at.CopyFrom(stamp(clock.now() + 60))
    await writer.commit(writer.txn().put(leased))
    with pytest.raises(RestoreRefused, match="mounted"):
        await dispatcher.restore("vol1", snapshot.meta.id, writer)
    await clock.advance(60)  # lease lapses, but an instance of the env still runs on the node
    running = factories.assignment("n1", "e1", "rel1")
    await writer.commit(writer.txn().put(running))
    with pytest.raises(RestoreRefused, match="mounted"):
        await dispatcher.restore("vol1", snapshot.meta.id, writer)
    await writer.commit(writer.txn().delete(f"assignment.n1.{running.meta.id}"))

    await dispatcher.restore("vol1", snapshot.meta.id, writer)
    assert tar_bytes(root) == expected
    assert view.volume("vol1").status == pb.VOLUME_STATUS_ACTIVE  # type: ignore[union-attr]
    with pytest.raises(RestoreRefused, match="not COMPLETE"):
        await dispatcher.restore("vol1", "01MISSING", writer)


async def test_scheduler_snapshots_and_prunes_end_to_end(conn, view, writer, clock, agent) -> None:
    dispatcher = SnapshotDispatcher(conn, view, clock)
    loop = SnapshotScheduler(LoopDeps(conn, view, clock), dispatcher=dispatcher)
    loop.writer = writer
    volume = snap_volume("vol1", "@hourly", keep_last=1, created_at=BASE)
    await add_volume(writer, agent, volume, {"a": random.randbytes(32 << 10)})
    store = await SnapshotStore.open(conn.js)

    def complete() -> list[pb.VolumeSnapshot]:
        return [s for s in view.snapshots() if s.status == pb.SNAPSHOT_STATUS_COMPLETE]

    for _ in range(2):
        await clock.advance(3600)
        await loop.pass_once()
        await eventually(lambda: not dispatcher.volume_busy("vol1") and len(complete()) >= 1)
        write_tree(agent.volumes_root / "vol1", {"a": random.randbytes(32 << 10)})
    await loop.pass_once()  # keep_last 1: the first snapshot is deleted and pruned
    assert len(complete()) == 1
    keep = complete()[0].meta.id
    await eventually(lambda: not loop._prunes)
    assert [m.name for m in await store.list("manifests/")] == [f"manifests/{keep}"]


def _at(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


async def test_restore_refused_while_another_restore_holds_the_volume(dispatcher, writer) -> None:
    """Before: only this process's own restores were excluded; a second CLI restored over a running one."""
    volume = snap_volume("vol1")
    volume.status = pb.VOLUME_STATUS_RESTORING
    snapshot = snapshot_record("vol1", BASE)
    await writer.commit(writer.txn().put(factories.node("n1")).put(volume).put(snapshot))
    with pytest.raises(SnapshotBusy, match="already being restored"):
        await dispatcher.restore("vol1", snapshot.meta.id, writer)


async def test_restoring_volume_is_stamped_then_touched_while_the_node_reports_progress(
    conn, view, writer, clock
) -> None:
    """The reaper measures a RESTORING volume's silence from ``updated_at``: set when the restore starts,
    refreshed every ``touch_every`` of progress, so only a restore whose driver died is given up."""
    dispatcher = SnapshotDispatcher(conn, view, clock, first_reply_timeout=5.0, idle_timeout=5.0, touch_every=600)
    snapshot = snapshot_record("vol1", BASE)
    await writer.commit(writer.txn().put(factories.node("n1")).put(snap_volume("vol1")).put(snapshot))
    requests: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await conn.nc.subscribe("zattera.agent.n1.restore", cb=requests.put)  # the node, played by the test
    await clock.advance(30)
    restore = asyncio.create_task(dispatcher.restore("vol1", snapshot.meta.id, writer))
    request = await asyncio.wait_for(requests.get(), 5)
    restoring = view.volume("vol1")
    assert restoring is not None and restoring.status == pb.VOLUME_STATUS_RESTORING
    assert _at(restoring.meta.updated_at) == BASE + 30

    async def report(sequence: int, phase: str) -> None:
        progress = cpb.SnapshotProgress(snapshot_id=snapshot.meta.id, sequence=sequence, phase=phase)
        await conn.nc.publish(request.reply, progress.SerializeToString())

    await clock.advance(599)
    await report(1, "download")  # within touch_every of the start: no write
    await clock.advance(1)
    await report(2, "download")
    await eventually(lambda: _at(view.volume("vol1").meta.updated_at) == BASE + 630)  # type: ignore[union-attr]
    await report(3, "done")
    await restore
    assert view.volume("vol1").status == pb.VOLUME_STATUS_ACTIVE  # type: ignore[union-attr]
    await sub.unsubscribe()


async def test_a_snapshot_or_restore_with_another_key_than_the_store_is_refused(
    conn, view, clock, agent, writer
) -> None:
    """Chunks are shared by every snapshot: one taken without the store's key (a CLI without
    ZATTERA_SNAPSHOT_KEY) would reference sealed chunks it cannot read, and block GC."""
    sealed = SnapshotDispatcher(conn, view, clock, target=cpb.SnapshotTarget(data_key=bytes(range(32))))
    unsealed = SnapshotDispatcher(conn, view, clock)
    volume = snap_volume("vol1")
    await add_volume(writer, agent, volume, {"a.bin": random.randbytes(10 << 10)})
    first = await sealed.snapshot(volume, writer)
    assert first.status == pb.SNAPSHOT_STATUS_COMPLETE, first.error
    assert first.key_fingerprint == key_fingerprint(sealed.target) != ""
    await eventually(lambda: view.snapshot(first.meta.id) == first, what="the record in the view")

    with pytest.raises(SnapshotKeyMismatch, match="ZATTERA_SNAPSHOT_KEY"):
        await unsealed.snapshot(volume, writer)
    with pytest.raises(SnapshotKeyMismatch, match="ZATTERA_SNAPSHOT_KEY"):
        await unsealed.restore(volume.meta.id, first.meta.id, writer)
    assert [r.meta.id for r in view.snapshots()] == [first.meta.id], "nothing written for the refused snapshot"
