"""Retention of volume snapshots on an off-site target: the rules on a real directory target (what goes, in
which order, what a shared chunk, a young chunk, another volume's index and an unreadable index keep), then
the secrets service's ``snapshot-offsite`` loop on real components (a real nats-server, the S3 API server,
a real snapshot agent): a volume keeping 2 snapshots keeps 2 on the target, the chunks only the pruned one
used go once a day old, and the volume still comes back byte for byte from what is left."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.secrets.offsite import by_target, pending
from shared import keys as K
from shared.actions.volumes import (
    RestoreVolume,
    SetSnapshotPolicy,
    TakeSnapshot,
    restore_volume,
    set_snapshot_policy,
    take_snapshot,
)
from shared.backup.manifest import Entry
from shared.backup.offsite import INDEX, ROOT, OffsiteSnapshot, index_name, offsite_ids
from shared.backup.offsite_retention import doomed_snapshots, prune_offsite
from shared.backup.retention import ORPHAN_GRACE
from shared.backup.targets import DirectoryTarget, credentials_from_environment, open_target
from shared.clock import FakeClock
from shared.snapshots.store import SnapshotStore
from shared.subjects import EVENTS_SUBJECT_PREFIX
from tests.backup.conftest import BUCKET
from tests.backup.test_drill import cluster
from tests.backup.test_offsite import _loop, _of, _seen
from tests.backup.test_schedule import _events
from tests.backup.test_volumes import VOLUME, _snap, _volume, old_volume

DAY = 24 * 3600.0
SPACE = f"{ROOT}unsealed/"


@pytest.mark.parametrize(
    ("ids", "keep", "doomed"),
    [
        (["a", "b", "c"], 2, ["a"]),
        (["a", "b", "c"], 3, []),
        (["a", "b"], 7, []),
        (["a", "b", "c", "d"], 1, ["a", "b", "c"]),
        ([], 2, []),
        (["a", "b"], 0, []),  # never to none: a count below 1 deletes nothing
    ],
)
def test_doomed_are_the_older_than_the_newest_kept(ids: list[str], keep: int, doomed: list[str]) -> None:
    assert doomed_snapshots(ids, keep) == doomed


def test_only_the_newest_kept_snapshots_are_copied_and_targets_group_their_volumes() -> None:
    away, home, other = _volume("v1", "e"), _volume("v2", "e"), _volume("v3", "e")
    away.snapshot_policy.offsite_target = other.snapshot_policy.offsite_target = "s3://b/p"
    away.snapshot_policy.keep_last = 2
    snaps = [_snap(f"s{i}", "v1", 10 * i) for i in (3, 1, 4, 2)] + [_snap("h1", "v2", 5), _snap("o1", "v3", 1)]
    assert [s.meta.id for _, s in pending([away, home, other], snaps)] == ["o1", "s3", "s4"]
    assert {url: [v.meta.id for v in vs] for url, vs in by_target([other, home, away]).items()} == {
        "s3://b/p": ["v1", "v3"]
    }


def _index(target: DirectoryTarget, volume_id: str, snapshot_id: str, chunks: list[str]) -> None:
    """A snapshot on the target as a copy leaves it: its chunks and manifest, then its index."""
    record = pb.VolumeSnapshot(volume_id=volume_id)
    record.meta.id = snapshot_id
    objects = [f"{SPACE}manifests/{snapshot_id}", *(f"{SPACE}chunks/{c}" for c in chunks)]
    for name in objects:
        target.put(name, name.encode())
    entries = tuple(Entry(name, name.removeprefix(SPACE), "0" * 64, len(name)) for name in objects)
    target.put(index_name(volume_id, snapshot_id), OffsiteSnapshot(record, volume_id, entries, 0.0).to_json())


def _age(target: DirectoryTarget, name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(target.root / name, (then, then))


def _names(target: DirectoryTarget) -> set[str]:
    return set(target.list(ROOT))


def test_a_target_keeps_each_volumes_newest_and_every_chunk_still_named(tmp_path: Path) -> None:
    target = DirectoryTarget(tmp_path / "t")
    _index(target, "v1", "s1", ["only-s1", "shared"])
    _index(target, "v1", "s2", ["shared", "s2"])
    _index(target, "v1", "s3", ["s3"])
    _index(target, "v2", "t1", ["only-s1-young"])  # another volume's snapshot, no policy names it here
    _index(target, "v2", "t0", ["t0"])
    for name in _names(target):
        _age(target, name, 2 * DAY)
    target.put(f"{SPACE}chunks/young", b"a copy in progress wrote it")
    target.put(f"{SPACE}chunks/only-s1-young", b"named by v2's index")

    pruned = prune_offsite(target, {"v1": 2}, time.time())

    assert pruned.deleted == {"v1": ["s1"]} and not pruned.kept_objects
    assert offsite_ids(target, "v1") == ["s2", "s3"] and offsite_ids(target, "v2") == ["t0", "t1"]
    names = _names(target)
    assert f"{SPACE}manifests/s1" not in names and f"{SPACE}chunks/only-s1" not in names
    assert pruned.objects_deleted == 2
    for kept in ("shared", "s2", "s3", "young", "only-s1-young", "t0"):
        assert f"{SPACE}chunks/{kept}" in names, kept

    # Three young snapshots more (a copy just wrote them): s2, s3 and s4 lose index and manifest at once; the
    # old chunks no index names any more go with them, s4's young one waits for the grace.
    for i in (4, 5, 6):
        _index(target, "v1", f"s{i}", [f"s{i}"])
    pruned = prune_offsite(target, {"v1": 2}, time.time())
    assert pruned.deleted == {"v1": ["s2", "s3", "s4"]} and pruned.objects_deleted == 6  # 3 manifests, 3 chunks
    names = _names(target)
    assert not {f"{SPACE}manifests/s{i}" for i in (2, 3, 4)} & names
    assert not {f"{SPACE}chunks/{c}" for c in ("s2", "s3", "shared")} & names
    assert f"{SPACE}chunks/s4" in names and f"{SPACE}chunks/young" in names
    pruned = prune_offsite(target, {"v1": 2}, time.time() + ORPHAN_GRACE)
    assert pruned.deleted == {} and pruned.objects_deleted == 2  # s4 and young: a day old, named by none
    assert {f"{SPACE}chunks/{c}" for c in ("s5", "s6", "only-s1-young", "t0")} <= _names(target)


def test_an_unreadable_index_keeps_every_object(tmp_path: Path) -> None:
    target = DirectoryTarget(tmp_path / "t")
    for i in (1, 2, 3):
        _index(target, "v1", f"s{i}", [f"c{i}"])
    target.put(f"{INDEX}v9/x.json", b"{not json")
    for name in _names(target):
        _age(target, name, 2 * DAY)

    pruned = prune_offsite(target, {"v1": 1}, time.time())

    assert pruned.deleted == {"v1": ["s1", "s2"]} and pruned.objects_deleted == 0
    assert "v9/x.json is not an off-site snapshot index" in pruned.kept_objects
    assert {f"{SPACE}chunks/c{i}" for i in (1, 2, 3)} <= _names(target)


async def test_the_loop_prunes_the_target_to_the_policy_and_what_is_left_restores(
    s3: str, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"  # the S3 server's buckets outlive one test: a prefix of its own
    kept_part = os.urandom(2 << 20)
    async with cluster(nats_url, tmp_path / "c") as c, old_volume(c, tmp_path) as root:
        events = await _events(c.conn)
        settings = credentials_from_environment()
        await set_snapshot_policy(c.ctx, SetSnapshotPolicy(VOLUME, keep_last=2, offsite=url, settings=settings))
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            monkeypatch.delenv(name)  # the secrets service has none of the operator's environment
        target = open_target(url, settings)
        clock = FakeClock(time.time())
        loop = _loop(c, clock)
        taken: list[str] = []
        contents: list[bytes] = []
        for _ in range(3):
            contents.append(os.urandom(512 << 10))
            (root / "kept.bin").write_bytes(kept_part)
            (root / "changing.bin").write_bytes(contents[-1])
            taken.append((await take_snapshot(c.ctx, TakeSnapshot(VOLUME))).snapshot_id)
            await loop.run_pass()  # copies the new one; prunes the target at most once an hour
            await clock.advance(3600)
        # The scheduler's own retention is not running here: the local store still holds all three.
        assert offsite_ids(target, VOLUME) == taken[1:]
        (pruned,) = await _seen(events, "volume.offsite_pruned", 1)
        assert pruned.fields["snapshots"] == taken[0] and pruned.fields["keep"] == "2", pruned.message
        assert pruned.environment_id == c.view.volume(VOLUME).environment_id  # type: ignore[union-attr]
        assert not _of(events, "volume.offsite_failed") and not _of(events, "volume.offsite_prune_failed")
        objects = set(target.list(ROOT))
        assert not any(taken[0] in n for n in objects), "the pruned snapshot's index and manifest are gone"
        young = len(objects)

        # A day on, the chunks only the pruned snapshot named go; nothing is copied again.
        await clock.advance(DAY)
        await loop.run_pass()
        left = set(target.list(ROOT))
        assert left < objects and young - len(left) >= 1, (young, len(left))
        assert len(_of(events, "volume.offsite_copied")) == 3

        # The oldest snapshot left comes back byte for byte from the target alone.
        store = await SnapshotStore.open(c.conn.js)
        for obj in await store.list(""):
            await store.delete(obj.name)
        for gone in taken:
            await c.ctx.writer.commit(c.ctx.writer.txn().delete(K.snapshot(gone)))
        await c.ctx.writer.commit(c.ctx.writer.txn().delete(K.assignment("01OLDNODE", "01ASG")))
        (root / "kept.bin").unlink()
        (root / "changing.bin").unlink()
        restored = await restore_volume(c.ctx, RestoreVolume(VOLUME, taken[1], source=url, settings=settings))
        assert restored.snapshot_id == taken[1] and restored.finished
        assert (root / "kept.bin").read_bytes() == kept_part
        assert (root / "changing.bin").read_bytes() == contents[1]


async def test_a_target_failing_its_copies_is_not_pruned_until_one_works(nats_url: str, tmp_path: Path) -> None:
    place = tmp_path / "offsite"
    async with cluster(nats_url, tmp_path / "c") as c, old_volume(c, tmp_path) as root:
        events = await _events(c.conn)
        (root / "f").write_bytes(b"data")
        await take_snapshot(c.ctx, TakeSnapshot(VOLUME))
        await set_snapshot_policy(c.ctx, SetSnapshotPolicy(VOLUME, keep_last=1, offsite=str(place)))
        place.rmdir()
        place.write_text("a file where the snapshots should go")
        clock = FakeClock(time.time())
        loop = _loop(c, clock)
        await loop.run_pass()
        await _seen(events, "volume.offsite_failed", 1)
        await c.conn.nc.publish(f"{EVENTS_SUBJECT_PREFIX}test.marker", pb.Event(kind="test.marker").SerializeToString())
        await _seen(events, "test.marker", 1)  # published after whatever the pass published, on one connection
        assert not _of(events, "volume.offsite_prune_failed"), "the copy's failure is the one event"

        place.unlink()
        (root / "f").write_bytes(b"data, changed")
        await take_snapshot(c.ctx, TakeSnapshot(VOLUME))
        await clock.advance(3600)
        await loop.run_pass()
        assert len(await _seen(events, "volume.offsite_copied", 1)) == 1  # the newest (it keeps 1) only
        assert len(offsite_ids(DirectoryTarget(place), VOLUME)) == 1
        assert not _of(events, "volume.offsite_prune_failed")
