"""Volume data in backups on real components: a volume's latest COMPLETE snapshot (taken by a real snapshot
agent on a real nats-server) goes to the S3 server with its chunks, an unchanged cluster's second backup
sends almost nothing, and a restore into a fresh cluster puts the objects back byte for byte and rebuilds
the volume on the new cluster's node before its env exists. Plus the pure choices (latest snapshot, new
homes) as table tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nacl import pwhash
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.handlers import SnapshotAgent
from shared.actions.backup import CreateBackup, VerifyBackup, create_backup, read_manifest, verify_backup
from shared.actions.backup_restore import RestoreBackup, restore_backup
from shared.actions.volumes import TakeSnapshot, take_snapshot
from shared.backup import recovery
from shared.backup.cluster import BucketCopy, read_state
from shared.backup.manifest import SNAPSHOTS, Corrupt
from shared.backup.targets import open_target
from shared.backup.volumes import latest_snapshots, new_homes
from shared.embedded import EmbeddedNats
from shared.objects import read_object
from shared.subjects import SNAPSHOTS_STORE
from tests import factories
from tests.backup.conftest import BUCKET
from tests.backup.test_drill import ENV, PASSPHRASE, Cluster, cluster, populate, publish_key

VOLUME = "01VOL"


@pytest.fixture(autouse=True)
def quick_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery, "OPSLIMIT", pwhash.argon2id.OPSLIMIT_MIN)
    monkeypatch.setattr(recovery, "MEMLIMIT", pwhash.argon2id.MEMLIMIT_MIN)


@contextlib.asynccontextmanager
async def old_volume(old: Cluster, tmp_path: Path) -> AsyncIterator[Path]:
    """The old cluster populated, with volume :data:`VOLUME` of its env on its node, whose snapshot agent
    runs meanwhile: yields the volume's directory."""
    await populate(old)
    await old.ctx.writer.commit(old.ctx.writer.txn().create(_volume(VOLUME, ENV, "01OLDNODE")))
    agent = SnapshotAgent(old.conn, "01OLDNODE", tmp_path / "old-volumes")
    await agent.start()
    try:
        root = tmp_path / "old-volumes" / VOLUME
        root.mkdir(parents=True)
        yield root
    finally:
        await agent.stop()


def _volume(volume_id: str, env: str, node: str = "") -> pb.Volume:
    v = pb.Volume(project_id="01PROJ", environment_id=env, name=f"data-{volume_id}", node_id=node)
    v.status = pb.VOLUME_STATUS_NODE_LOST
    v.meta.id = volume_id
    return v


def _snap(snapshot_id: str, volume_id: str, at: int, status: int = pb.SNAPSHOT_STATUS_COMPLETE) -> pb.VolumeSnapshot:
    s = pb.VolumeSnapshot(volume_id=volume_id, status=status, manifest_key=snapshot_id)  # type: ignore[arg-type]
    s.meta.id = snapshot_id
    s.meta.created_at.seconds = at
    return s


def test_latest_snapshot_is_the_newest_complete_one_of_a_volume_that_exists() -> None:
    records = [
        _snap("s1", "v1", 10),
        _snap("s2", "v1", 20),
        _snap("s3", "v1", 30, pb.SNAPSHOT_STATUS_FAILED),
        _snap("s4", "v1", 25, pb.SNAPSHOT_STATUS_RUNNING),
        _snap("s5", "v2", 5),
        _snap("s6", "gone", 50),
    ]
    values = {f"snapshot.{s.meta.id}": s.SerializeToString() for s in records}
    values |= {f"volume.{v}": _volume(v, "e").SerializeToString() for v in ("v1", "v2", "v3")}
    latest = latest_snapshots(BucketCopy(1, values))
    assert {v: s.meta.id for v, s in latest.items()} == {"v1": "s2", "v2": "s5"}


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([], {}),
        ([factories.node("n1", status=pb.NODE_STATUS_DOWN)], {}),
        ([factories.node("n1", schedulable=False)], {}),
        ([factories.node("n1", roles=(pb.NODE_ROLE_CONTROL,))], {}),
        ([factories.node("n2"), factories.node("n1")], {"a1": "n1", "a2": "n1", "b1": "n2", "c1": "n2"}),
    ],
)
def test_new_homes_keep_an_envs_volumes_together_and_spread_envs(
    nodes: list[pb.Node], expected: dict[str, str]
) -> None:
    volumes = [_volume("a1", "ea"), _volume("a2", "ea"), _volume("b1", "eb"), _volume("c1", "ec")]
    assert new_homes(volumes, nodes) == expected


async def test_a_volumes_latest_snapshot_is_backed_up_by_chunk_and_rebuilt_on_the_new_node(
    s3: str, nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = f"s3://{BUCKET}/vol"
    photo = os.urandom(3 << 20)
    async with cluster(nats_url, tmp_path / "old") as old:
        async with old_volume(old, tmp_path) as root:
            (root / "uploads").mkdir()
            (root / "uploads/photo.bin").write_bytes(photo)
            (root / "notes.txt").write_bytes(b"first")
            first_snap = await take_snapshot(old.ctx, TakeSnapshot(VOLUME))
            (root / "notes.txt").write_bytes(b"second, the one a restore brings back")
            latest = await take_snapshot(old.ctx, TakeSnapshot(VOLUME))
        assert first_snap.status == latest.status == "COMPLETE"
        first = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
        second = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
        old_objects = {
            name: await read_object(old.conn.js, SNAPSHOTS_STORE, name) for name in [f"manifests/{latest.snapshot_id}"]
        }
    # The chunks went with the first backup; the second, of an unchanged cluster, sends < 1 % of it.
    assert first.sent_bytes > len(photo) // 2, first
    assert second.sent_bytes < first.sent_bytes / 100, (first, second)

    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        await new.ctx.writer.commit(new.ctx.writer.txn().create(factories.node("01NEWNODE")))
        agent = SnapshotAgent(new.conn, "01NEWNODE", tmp_path / "new-volumes")
        await agent.start()
        try:
            restored = await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        finally:
            await agent.stop()
        assert restored.volumes == [VOLUME], restored.skipped
        # Every snapshot object the backup carried is back under its name, byte for byte.
        manifest = read_manifest(open_target(target), restored.id)
        carried = manifest.of_kind(SNAPSHOTS)
        assert len(carried) >= 2 and {e.meta["snapshot"] for e in carried} == {latest.snapshot_id}
        for name, data in old_objects.items():
            assert await read_object(new.conn.js, SNAPSHOTS_STORE, name) == data
        for entry in carried:
            data = await read_object(new.conn.js, SNAPSHOTS_STORE, entry.name)
            assert data is not None and len(data) == entry.size
        # The volume is pinned to the new node, its data rebuilt there from the latest snapshot.
        new_root = tmp_path / "new-volumes" / VOLUME
        assert (new_root / "uploads/photo.bin").read_bytes() == photo
        assert (new_root / "notes.txt").read_bytes() == b"second, the one a restore brings back"
        after = await read_state(new.conn)
        volume = pb.Volume.FromString(after.values[f"volume.{VOLUME}"])
        assert volume.node_id == "01NEWNODE" and volume.status == pb.VOLUME_STATUS_ACTIVE
        # Only the carried snapshot's record comes back (the older one's objects are not in the backup).
        assert f"snapshot.{latest.snapshot_id}" in after.values
        assert f"snapshot.{first_snap.snapshot_id}" not in after.values
        assert f"env.{ENV}" in after.values


async def test_a_volume_whose_data_cannot_be_rebuilt_is_named_with_the_command_that_does_it(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """No agent answers on the new node: the restore still completes, the objects are back, and the
    volume's line says what to run once the node's agent is up."""
    target = str(tmp_path / "backups")
    async with cluster(nats_url, tmp_path / "old") as old:
        async with old_volume(old, tmp_path) as root:
            (root / "f").write_bytes(b"data")
            taken = await take_snapshot(old.ctx, TakeSnapshot(VOLUME))
        created = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
    # A damaged chunk is named by verify and refused by restore before anything is written.
    chunk = next(e for e in read_manifest(open_target(target), created.id).of_kind(SNAPSHOTS) if "chunks/" in e.name)
    blob = tmp_path / "backups" / "blobs" / chunk.sha256
    good = blob.read_bytes()
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(Corrupt, match=f"object snapshots/{chunk.name} does not match its SHA-256"):
        await verify_backup(VerifyBackup(target, created.id))
    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        await new.ctx.writer.commit(new.ctx.writer.txn().create(factories.node("01NEWNODE")))
        with pytest.raises(Corrupt, match=f"object snapshots/{chunk.name}"):
            await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        assert new.view.env(ENV) is None
        blob.write_bytes(good)
        restored = await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        assert restored.volumes == []
        note = next(s for s in restored.skipped if s.startswith(f"volume {VOLUME}"))
        assert f"zattera volumes restore {VOLUME} {taken.snapshot_id}" in note, restored.skipped
        assert await read_object(new.conn.js, SNAPSHOTS_STORE, f"manifests/{taken.snapshot_id}") is not None
        volume = pb.Volume.FromString((await read_state(new.conn)).values[f"volume.{VOLUME}"])
        assert volume.node_id == "01NEWNODE" and volume.status == pb.VOLUME_STATUS_ACTIVE
