"""Volume snapshots off-site on real components: a real nats-server, the S3 API server (moto), a real snapshot
agent and the secrets service's ``snapshot-offsite`` loop. A volume's policy names the target (its settings
sealed to the cluster key, the operator's environment gone afterwards); a 16 MiB file goes once, the next
snapshot sends only the changed chunk; with the local snapshot store wiped the volume comes back byte for
byte from the target. A failing target is loud, and bad input names the field."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.secrets.offsite import OffsiteSnapshots, pending
from shared import keys as K
from shared.actions.refusals import Invalid, NotFound
from shared.actions.volumes import (
    RestoreVolume,
    SetSnapshotPolicy,
    TakeSnapshot,
    restore_volume,
    set_snapshot_policy,
    take_snapshot,
)
from shared.backup.offsite import index_name, offsite_ids
from shared.backup.targets import credentials_from_environment, open_target
from shared.clock import FakeClock
from shared.embedded import EmbeddedNats
from shared.loop import LoopDeps
from shared.secrets import load_keyring
from shared.snapshots.store import SnapshotStore
from tests.backup.conftest import ACCESS_KEY, BUCKET, SECRET_KEY
from tests.backup.test_drill import ENV, Cluster, cluster, populate
from tests.backup.test_schedule import _events
from tests.backup.test_volumes import VOLUME, _snap, _volume, old_volume
from tests.cli.rig import initialised_cli
from tests.waiting import eventually

MIB = 1 << 20


def _loop(c: Cluster, clock: FakeClock) -> OffsiteSnapshots:
    keyring = load_keyring(c.keyring)
    assert keyring is not None
    return OffsiteSnapshots(LoopDeps(c.conn, c.view, clock, coalesce=0.0), lambda: keyring)


def _of(events: list[pb.Event], kind: str) -> list[pb.Event]:
    return [e for e in events if e.kind == kind]


async def _seen(events: list[pb.Event], kind: str, count: int) -> list[pb.Event]:
    """The events of ``kind`` once ``count`` of them arrived."""
    await eventually(lambda: len(_of(events, kind)) >= count, 10, f"{count} {kind} event(s)")
    return _of(events, kind)


def test_pending_is_every_complete_snapshot_of_a_volume_with_a_target_oldest_first() -> None:
    away, home = _volume("v1", "e"), _volume("v2", "e")
    away.snapshot_policy.offsite_target = "s3://b/p"
    snaps = [_snap("s2", "v1", 20), _snap("s1", "v1", 10), _snap("s3", "v1", 30, pb.SNAPSHOT_STATUS_FAILED)]
    snaps += [_snap("s4", "v1", 40, pb.SNAPSHOT_STATUS_RUNNING), _snap("s5", "v2", 5)]
    assert [s.meta.id for _, s in pending([away, home], snaps)] == ["s1", "s2"]


async def test_snapshots_go_off_site_by_chunk_and_a_volume_comes_back_from_there(
    s3: str, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{BUCKET}/offsite"
    big = bytearray(os.urandom(16 * MIB))
    async with cluster(nats_url, tmp_path / "c") as c, old_volume(c, tmp_path) as root:
        events = await _events(c.conn)
        (root / "big.bin").write_bytes(big)
        first = await take_snapshot(c.ctx, TakeSnapshot(VOLUME))
        assert first.status == "COMPLETE", first
        settings = credentials_from_environment()
        done = await set_snapshot_policy(c.ctx, SetSnapshotPolicy(VOLUME, offsite=url, settings=settings))
        assert done.offsite == url and "AWS_SECRET_ACCESS_KEY" in done.offsite_settings
        volume = c.view.volume(VOLUME)
        assert volume is not None and volume.snapshot_policy.offsite_key_id
        raw = K.encode(volume)
        assert SECRET_KEY.encode() not in raw and ACCESS_KEY.encode() not in raw, "settings stored sealed only"
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            monkeypatch.delenv(name)  # the secrets service has none of the operator's environment

        loop = _loop(c, FakeClock())
        await loop.run_pass()
        target = open_target(url, settings)
        assert offsite_ids(target, VOLUME) == [first.snapshot_id]
        (copied,) = await _seen(events, "volume.offsite_copied", 1)
        assert int(copied.fields["sent_bytes"]) > 16 * MIB, copied.message
        assert copied.fields["snapshot"] == first.snapshot_id and copied.environment_id == volume.environment_id

        # One byte changed in the middle: the next snapshot sends its chunk (and the manifest, the index).
        big[8 * MIB] ^= 0xFF
        (root / "big.bin").write_bytes(big)
        second = await take_snapshot(c.ctx, TakeSnapshot(VOLUME))
        await loop.run_pass()
        again = [
            e for e in await _seen(events, "volume.offsite_copied", 2) if e.fields["snapshot"] == second.snapshot_id
        ]
        assert len(again) == 1, [e.message for e in events]
        sent = int(again[0].fields["sent_bytes"])
        assert sent < 5 * MIB and int(again[0].fields["sent_objects"]) <= 5, again[0].message
        await loop.run_pass()
        assert len(_of(events, "volume.offsite_copied")) == 2, "a snapshot on the target is not copied again"
        assert offsite_ids(target, VOLUME) == sorted([first.snapshot_id, second.snapshot_id])
        # A new term learns what the target holds from its indexes: nothing is sent again.
        loop.on_term_start()
        await loop.run_pass()
        assert len(_of(events, "volume.offsite_copied")) == 2

        # The local snapshot store is lost (every object), the latest record too, and the volume's files.
        store = await SnapshotStore.open(c.conn.js)
        for obj in await store.list(""):
            await store.delete(obj.name)
        await c.ctx.writer.commit(c.ctx.writer.txn().delete(K.snapshot(second.snapshot_id)))
        (root / "big.bin").unlink()
        stop = c.ctx.writer.txn().delete(K.assignment("01OLDNODE", "01ASG"))  # its env stopped (not mounted)
        await c.ctx.writer.commit(stop)
        restored = await restore_volume(c.ctx, RestoreVolume(VOLUME, "", source=url, settings=settings))
        assert restored.snapshot_id == second.snapshot_id and restored.finished
        assert restored.fetched_bytes > 16 * MIB
        assert (root / "big.bin").read_bytes() == bytes(big), "the volume is back byte for byte"
        record = c.view.snapshot(second.snapshot_id)
        assert record is not None and record.status == pb.SNAPSHOT_STATUS_COMPLETE

        # An older snapshot by its id, from what the target holds.
        older = await restore_volume(c.ctx, RestoreVolume(VOLUME, first.snapshot_id, source=url, settings=settings))
        assert older.snapshot_id == first.snapshot_id
        big[8 * MIB] ^= 0xFF
        assert (root / "big.bin").read_bytes() == bytes(big)
        assert not _of(events, "volume.offsite_failed")


async def test_a_failing_target_is_loud_with_its_cause_and_retried(nats_url: str, tmp_path: Path) -> None:
    place = tmp_path / "offsite"
    async with cluster(nats_url, tmp_path / "c") as c, old_volume(c, tmp_path) as root:
        events = await _events(c.conn)
        (root / "f").write_bytes(b"data")
        taken = await take_snapshot(c.ctx, TakeSnapshot(VOLUME))
        await set_snapshot_policy(c.ctx, SetSnapshotPolicy(VOLUME, offsite=str(place)))
        place.rmdir()
        place.write_text("a file where the snapshots should go")
        clock = FakeClock()
        loop = _loop(c, clock)
        await loop.run_pass()
        (failed,) = await _seen(events, "volume.offsite_failed", 1)
        assert failed.severity == "error" and str(place) in failed.message and taken.snapshot_id in failed.message
        assert failed.fields["failures"] == "1" and loop.seconds_until_due() == 60.0

        await clock.advance(30)
        await loop.run_pass()
        assert len(_of(events, "volume.offsite_failed")) == 1, "no retry before the backoff"
        place.unlink()
        await clock.advance(30)
        await loop.run_pass()
        copied = await _seen(events, "volume.offsite_copied", 1)
        assert [e.fields["snapshot"] for e in copied] == [taken.snapshot_id]
        assert loop.seconds_until_due() is None
        assert (place / index_name(VOLUME, taken.snapshot_id)).is_file()

        # Settings the service cannot open are a failure too, naming the key (never a value).
        volume = c.view.volume(VOLUME)
        assert volume is not None
        other = pb.Volume()
        other.CopyFrom(volume)
        other.snapshot_policy.offsite_target = str(tmp_path / "elsewhere")
        other.snapshot_policy.offsite_sealed_settings = b"not sealed to anything"
        other.snapshot_policy.offsite_key_id = "k-unknown"
        await c.ctx.writer.commit(c.ctx.writer.txn().put(other))
        await loop.run_pass()
        failures = await _seen(events, "volume.offsite_failed", 2)
        assert "sealed to key k-unknown, which is not held" in failures[-1].message, failures[-1].message
        assert loop.seconds_until_due() == 60.0
        # A snapshot no longer there (pruned) is no longer retried.
        await c.ctx.writer.commit(c.ctx.writer.txn().delete(K.snapshot(taken.snapshot_id)))
        await eventually(lambda: c.view.snapshot(taken.snapshot_id) is None, 10, "the record is gone")
        await loop.run_pass()
        assert loop.seconds_until_due() is None


async def test_wrong_targets_and_credentials_are_refused_naming_the_field(
    s3: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with cluster(nats_server.url, tmp_path / "c") as c, old_volume(c, tmp_path):
        cases: list[tuple[SetSnapshotPolicy | RestoreVolume, type[Exception], str, str]] = [
            (SetSnapshotPolicy(VOLUME, offsite="ftp://host/x"), Invalid, "offsite", "unknown scheme 'ftp'"),
            (SetSnapshotPolicy(VOLUME, offsite="s3://no-such-bucket"), Invalid, "offsite", "NoSuchBucket"),
            (SetSnapshotPolicy("nope", offsite=str(tmp_path)), NotFound, "volume_id", "volume 'nope' not found"),
            (RestoreVolume(VOLUME, ""), Invalid, "snapshot_id", "give the snapshot"),
            (RestoreVolume(VOLUME, "", source="s3://"), Invalid, "source", "no bucket"),
            (RestoreVolume(VOLUME, "", source=str(tmp_path / "empty")), NotFound, "snapshot_id", "no off-site"),
        ]
        for request, refusal, field, says in cases:
            with pytest.raises(refusal) as refused:
                if isinstance(request, SetSnapshotPolicy):
                    await set_snapshot_policy(c.ctx, request)
                else:
                    await restore_volume(c.ctx, request)
            assert refused.value.field == field and says in str(refused.value), (request, str(refused.value))  # type: ignore[attr-defined]
        volume = c.view.volume(VOLUME)
        assert volume is not None and not volume.snapshot_policy.offsite_target

        # A target the given settings cannot use: the S3 server's own word for it, and no secret in the message.
        bad = {**credentials_from_environment(), "AWS_SECRET_ACCESS_KEY": "wrong-secret-value"}
        with pytest.raises(Invalid) as refused_creds:
            await restore_volume(c.ctx, RestoreVolume(VOLUME, "", source="s3://no-such-bucket", settings=bad))
        said = str(refused_creds.value)
        assert refused_creds.value.field == "source" and "NoSuchBucket" in said and "wrong-secret-value" not in said


def test_the_cli_sets_an_off_site_target_and_names_a_bad_one(
    s3: str, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    zattera = initialised_cli(nats_url)

    async def setup() -> None:
        async with cluster(nats_url, tmp_path / "c") as c:
            await populate(c)
            await c.ctx.writer.commit(c.ctx.writer.txn().create(_volume(VOLUME, ENV, "01OLDNODE")))

    asyncio.run(setup())
    url = f"s3://{BUCKET}/cli"
    done = zattera("volumes", "policy", VOLUME, "--offsite", url, "--json")
    assert done.exit_code == 0, done.output
    said = json.loads(done.stdout)
    assert said["offsite"] == url and "AWS_SECRET_ACCESS_KEY" in said["offsite_settings"]
    assert SECRET_KEY not in done.output and ACCESS_KEY not in done.output
    bad = zattera("volumes", "policy", VOLUME, "--offsite", "s3://no-such-bucket")
    assert bad.exit_code != 0 and "offsite" in bad.output and "NoSuchBucket" in bad.output, bad.output
    missing = zattera("volumes", "restore", VOLUME, "--from", url)
    assert missing.exit_code != 0 and f"holds no off-site snapshot of volume {VOLUME}" in missing.output
    stopped = zattera("volumes", "policy", VOLUME, "--offsite", "")
    assert stopped.exit_code == 0 and "off-site (none)" in stopped.output, stopped.output
