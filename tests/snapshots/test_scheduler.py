"""SnapshotScheduler on real NATS with a fake clock (C3 and the fixes of B1/D-B3/D-B4/D-B6).

The C3 cases use a recording dispatcher as the reference tests do (it records snapshot volume ids and
prune batches and writes nothing); "evaluate" is one pass of the loop.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.scheduler.snapshots import FAILED_KEEP, RETRY_AFTER, STUCK_AFTER, STUCK_ERROR, TICK, SnapshotScheduler
from shared.addons.spec import ADDON_VAR, BACKUPS_VOLUME
from shared.clock import FakeClock
from shared.connection import Connection
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.snapshots.guards import RecordNotWritten
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests import factories
from tests.snapshots.conftest import BASE, snap_volume, snapshot_record, stamp
from tests.waiting import eventually

H = 3600.0


class RecordingDispatcher:
    def __init__(self) -> None:
        self.snapshots: list[str] = []
        self.prunes: list[list[str]] = []
        self.fail_next_start = 0
        self.busy: set[str] = set()

    def volume_busy(self, volume_id: str) -> bool:
        return volume_id in self.busy

    def last_progress(self, snapshot_id: str) -> float | None:
        return None

    async def start_snapshot(self, volume: pb.Volume, writer: Writer) -> asyncio.Task[pb.VolumeSnapshot]:
        if self.fail_next_start:
            self.fail_next_start -= 1
            raise RecordNotWritten("state bucket unavailable")
        self.snapshots.append(volume.meta.id)
        return asyncio.create_task(asyncio.sleep(0, pb.VolumeSnapshot()))

    async def prune(self, volume: pb.Volume, snapshot_ids: list[str]) -> cpb.PruneSnapshotsResponse:
        self.prunes.append(sorted(snapshot_ids))
        return cpb.PruneSnapshotsResponse()


def make_loop(
    conn: Connection, view: StateView, clock: FakeClock, writer: Writer
) -> tuple[SnapshotScheduler, RecordingDispatcher]:
    dispatcher = RecordingDispatcher()
    loop = SnapshotScheduler(LoopDeps(conn, view, clock), dispatcher=dispatcher)
    loop.writer = writer
    return loop, dispatcher


async def test_fires_once_per_due_cron_slot(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    await writer.commit(writer.txn().put(snap_volume("vol1", "0 * * * *", 7, BASE)))
    await loop.pass_once()
    assert dispatcher.snapshots == []
    await clock.advance(65 * 60)
    await loop.pass_once()
    await loop.pass_once()
    assert dispatcher.snapshots == ["vol1"]
    await writer.commit(writer.txn().put(snapshot_record("vol1", clock.now())))
    await clock.advance(60 * 60)
    await loop.pass_once()
    assert dispatcher.snapshots == ["vol1", "vol1"]


async def test_manual_only_policy_never_fires(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    await writer.commit(writer.txn().put(snap_volume("vol1", "", 7)))
    await clock.advance(48 * H)
    await loop.pass_once()
    assert dispatcher.snapshots == []


async def test_keep_last_prunes_the_oldest_beyond_the_limit(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    records = [snapshot_record("vol1", BASE + i * H) for i in range(4)]
    txn = writer.txn().put(snap_volume("vol1", "", 2))
    for r in records:
        txn.put(r)
    await writer.commit(txn)
    await loop.pass_once()
    assert [s.meta.id for s in view.snapshots()] == [records[2].meta.id, records[3].meta.id]
    await eventually(lambda: dispatcher.prunes == [sorted([records[0].meta.id, records[1].meta.id])])


async def test_default_keep_last_is_7(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    txn = writer.txn().put(snap_volume("vol1", "", 0))
    for i in range(9):
        txn.put(snapshot_record("vol1", BASE + i * H))
    await writer.commit(txn)
    await loop.pass_once()
    assert len(view.snapshots()) == 7
    await eventually(lambda: len(dispatcher.prunes) == 1 and len(dispatcher.prunes[0]) == 2)


async def test_bad_schedule_never_fires_but_retention_still_applies(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    txn = writer.txn().put(snap_volume("vol1", "0 0 0 * * *", 1))
    for i in range(3):
        txn.put(snapshot_record("vol1", BASE + i * H))
    await writer.commit(txn)
    await clock.advance(48 * H)
    await loop.pass_once()
    assert dispatcher.snapshots == [] and len(view.snapshots()) == 1


async def test_outage_gives_one_catch_up_snapshot(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    await writer.commit(writer.txn().put(snap_volume("vol1", "0 * * * *", 7, BASE)))
    await clock.advance(10 * H + 60)  # ten slots missed
    await loop.pass_once()
    await writer.commit(writer.txn().put(snapshot_record("vol1", clock.now())))
    await loop.pass_once()
    assert dispatcher.snapshots == ["vol1"]


async def test_failed_dispatch_before_record_does_not_wedge_schedule(conn, view, writer, clock: FakeClock) -> None:
    """The reference never snapshotted that volume again for the rest of the leader term."""
    loop, dispatcher = make_loop(conn, view, clock, writer)
    dispatcher.fail_next_start = 1
    await writer.commit(writer.txn().put(snap_volume("vol1", "0 * * * *", 7, BASE)))
    await clock.advance(65 * 60)
    await loop.pass_once()
    assert dispatcher.snapshots == []
    await loop.pass_once()  # not before the retry delay
    assert dispatcher.snapshots == []
    await clock.advance(RETRY_AFTER)
    await loop.pass_once()
    assert dispatcher.snapshots == ["vol1"]


async def test_due_slot_waits_while_a_snapshot_of_the_volume_runs(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    await writer.commit(writer.txn().put(snap_volume("vol1", "*/5 * * * *", 7, BASE)))
    dispatcher.busy.add("vol1")
    await clock.advance(20 * 60)
    await loop.pass_once()
    assert dispatcher.snapshots == []
    dispatcher.busy.clear()
    await loop.pass_once()
    assert dispatcher.snapshots == ["vol1"]


async def test_stuck_running_becomes_failed_and_old_failures_are_deleted(conn, view, writer, clock: FakeClock) -> None:
    loop, dispatcher = make_loop(conn, view, clock, writer)
    stuck = snapshot_record("vol1", BASE, pb.SNAPSHOT_STATUS_RUNNING)
    newest = snapshot_record("vol1", BASE + 1, pb.SNAPSHOT_STATUS_COMPLETE)
    await writer.commit(writer.txn().put(snap_volume("vol1", "", 7)).put(stuck).put(newest))
    await clock.advance(STUCK_AFTER - 1)
    await loop.pass_once()
    assert view.snapshot(stuck.meta.id).status == pb.SNAPSHOT_STATUS_RUNNING  # type: ignore[union-attr]
    await clock.advance(1)
    await loop.pass_once()
    failed = view.snapshot(stuck.meta.id)
    assert failed is not None and failed.status == pb.SNAPSHOT_STATUS_FAILED and failed.error == STUCK_ERROR
    await clock.advance(FAILED_KEEP)
    await loop.pass_once()
    assert view.snapshot(stuck.meta.id) is None
    await eventually(lambda: dispatcher.prunes == [[stuck.meta.id]])


async def test_loop_fires_on_the_fake_clock_tick_while_leading(conn, view, writer, clock: FakeClock) -> None:
    """The running loop (not pass_once): the slot fires when the fake clock's tick elapses."""
    dispatcher = RecordingDispatcher()
    loop = SnapshotScheduler(LoopDeps(conn, view, clock, coalesce=0), dispatcher=dispatcher)
    await writer.commit(writer.txn().put(snap_volume("vol1", "0 * * * *", 7, BASE)))
    task = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="test"))
    try:
        await eventually(lambda: loop.passes >= 1 and clock.sleepers >= 1)
        assert dispatcher.snapshots == []
        while clock.now() < BASE + H + TICK:  # tick by tick, as time passes in production
            await clock.advance(TICK)
            await eventually(lambda: clock.sleepers >= 1)
            if clock.now() < BASE + H:
                assert dispatcher.snapshots == []  # nothing before the 01:00 slot
        await eventually(lambda: dispatcher.snapshots == ["vol1"])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_restore_whose_driver_died_is_reaped_back_to_a_usable_state(conn, view, writer, clock: FakeClock) -> None:
    """Before: a RESTORING volume whose restoring process (the CLI) died stayed RESTORING forever, so its
    service was never placed or leased again. Now the reaper gives up after ``restore_timeout``."""
    dispatcher = RecordingDispatcher()
    loop = SnapshotScheduler(LoopDeps(conn, view, clock), dispatcher=dispatcher, restore_timeout=H)
    loop.writer = writer
    events: list[pb.Event] = []

    async def on_event(msg: Msg) -> None:
        events.append(pb.Event.FromString(msg.data))

    sub = await conn.nc.subscribe(EVENTS_SUBJECT_PREFIX + "volume.>", cb=on_event)
    on_alive, on_down = snap_volume("vol1"), snap_volume("vol2", node_id="n2")
    txn = writer.txn().put(factories.node("n1")).put(factories.node("n2", status=pb.NODE_STATUS_DOWN))
    for volume in (on_alive, on_down):
        volume.status = pb.VOLUME_STATUS_RESTORING
        volume.meta.updated_at.CopyFrom(stamp(BASE + 60))  # entered RESTORING (or last touched) at BASE + 60
        txn.put(volume)
    await writer.commit(txn)

    await clock.advance(H)  # 59 min 0 s without a sign of life: the restore may still be running
    await loop.pass_once()
    assert {v.status for v in view.volumes()} == {pb.VOLUME_STATUS_RESTORING}
    await clock.advance(60)
    await loop.pass_once()
    assert view.volume("vol1").status == pb.VOLUME_STATUS_ACTIVE  # type: ignore[union-attr]
    assert view.volume("vol2").status == pb.VOLUME_STATUS_NODE_LOST  # type: ignore[union-attr]
    await eventually(lambda: len(events) == 2)
    await sub.unsubscribe()
    by_volume = {e.node_id: e for e in events}
    assert {e.kind for e in events} == {"volume.restore_failed"} and {e.severity for e in events} == {"warning"}
    assert by_volume["n1"].message == (
        'restore of volume "data" abandoned: no progress for 3600s (the process running it is gone); '
        "volume back to active"
    )
    assert by_volume["n2"].message.endswith("volume back to node_lost (node n2 is not alive)")
    await loop.pass_once()  # nothing more to reap
    await conn.nc.flush()
    assert len(events) == 2


async def test_an_addons_backup_volume_without_a_schedule_is_copied_hourly(
    conn, view, writer, clock: FakeClock
) -> None:
    """The platform's schedule for what restores a database (its node lost, its backups are not); any other
    volume without a schedule stays manual."""
    loop, dispatcher = make_loop(conn, view, clock, writer)
    database = factories.env("e1")
    database.service.vars[ADDON_VAR] = "postgres:15"
    plain = factories.env("e2")
    backups = snap_volume("vol-backups", "", 7, BASE)
    backups.name = BACKUPS_VOLUME
    data = snap_volume("vol-data", "", 7, BASE)  # the database's data volume: pgBackRest's copy is the backup
    other = snap_volume("vol-other", "", 7, BASE)
    other.environment_id = "e2"
    await writer.commit(writer.txn().put(database).put(plain).put(backups).put(data).put(other))
    await clock.advance(65 * 60)
    await loop.pass_once()
    assert dispatcher.snapshots == ["vol-backups"]
