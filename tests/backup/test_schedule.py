"""Scheduled backups: when a run is due (table, fake clock), which backups retention deletes, the recovery
recipient, and the secrets service's ``backups`` loop on a real nats-server writing to a real S3 API server
(moto on loopback) with credentials it holds only sealed, failing loudly and recovering."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from nacl import pwhash
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from services.secrets.backups import ScheduledBackups, next_run
from shared import keys as K
from shared.actions.backup_schedule import ScheduleBackups, UnscheduleBackups, schedule_backups, unschedule_backups
from shared.actions.context import ActionContext
from shared.actions.refusals import Invalid
from shared.backup import recovery, retention
from shared.backup.manifest import SECRETS_KEY, blob_name, manifest_name, parse_manifest
from shared.backup.status import SCHEDULE_ID, backup_status, describe
from shared.backup.targets import DirectoryTarget, credentials_from_environment, open_target
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, Keyring, key_id, public_bytes
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests.backup.conftest import ACCESS_KEY, BUCKET, SECRET_KEY
from tests.waiting import eventually

PASSPHRASE = "correct horse battery staple"
HOUR = 3600.0


@pytest.fixture(autouse=True)
def quick_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    """libsodium's minimum Argon2id limits: the KDF's cost is not what these tests measure."""
    monkeypatch.setattr(recovery, "OPSLIMIT", pwhash.argon2id.OPSLIMIT_MIN)
    monkeypatch.setattr(recovery, "MEMLIMIT", pwhash.argon2id.MEMLIMIT_MIN)


def _schedule(cron: str, updated_at: float, *, paused: bool = False) -> pb.BackupSchedule:
    s = pb.BackupSchedule(schedule=cron, keep=3, target="/tmp/x", paused=paused)
    s.meta.updated_at.FromNanoseconds(int(updated_at * 1e9))
    return s


def _run(started: float, *, ok: bool, failures: int = 0, finished: float | None = None) -> pb.BackupRun:
    r = pb.BackupRun(ok=ok, failures=failures)
    r.started_at.FromNanoseconds(int(started * 1e9))
    r.finished_at.FromNanoseconds(int((finished if finished is not None else started + 10) * 1e9))
    return r


T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


@pytest.mark.parametrize(
    ("schedule", "run", "due"),
    [
        pytest.param(_schedule("@every 1h", T0), None, T0 + HOUR, id="never-ran: a slot after the schedule was set"),
        pytest.param(_schedule("@every 1h", T0), _run(T0 + 5 * HOUR, ok=True), T0 + 6 * HOUR, id="after-a-run"),
        pytest.param(
            _schedule("@every 1h", T0), _run(T0 + HOUR, ok=False, failures=1), T0 + HOUR + 10 + 60, id="first-retry"
        ),
        pytest.param(
            _schedule("@every 1h", T0), _run(T0 + HOUR, ok=False, failures=3), T0 + HOUR + 10 + 240, id="backoff"
        ),
        pytest.param(
            _schedule("@every 1h", T0),
            _run(T0 + HOUR, ok=False, failures=30),
            T0 + 2 * HOUR,
            id="retry-never-later-than-the-next-slot",
        ),
        pytest.param(
            _schedule("@every 1h", T0 + 3 * HOUR),
            _run(T0 + HOUR, ok=False, failures=2),
            T0 + 4 * HOUR,
            id="a-new-schedule-starts-afresh",
        ),
        pytest.param(_schedule("0 3 * * *", T0), None, 1_700_017_200.0, id="cron: next 03:00 UTC"),
        pytest.param(_schedule("@every 1h", T0, paused=True), None, None, id="paused"),
        pytest.param(_schedule("not a cron", T0), None, None, id="bad-schedule"),
    ],
)
def test_when_a_scheduled_backup_is_due(schedule: pb.BackupSchedule, run: pb.BackupRun | None, due: float) -> None:
    assert next_run(schedule, run).at == due


@pytest.mark.parametrize(
    ("ids", "verified", "keep", "doomed"),
    [
        (["a", "b", "c", "d"], {"a", "b", "c", "d"}, 2, ["a", "b"]),
        (["a", "b", "c", "d"], {"a", "b", "c", "d"}, 4, []),
        # an unverified newest backup does not push a verified one out
        (["a", "b", "c", "d"], {"a", "b", "c"}, 2, ["a"]),
        # fewer verified than keep: nothing goes, not even unverified old ones
        (["a", "b", "c"], {"c"}, 2, []),
        # unverified backups older than the kept verified ones go with them
        (["a", "b", "c", "d", "e"], {"c", "e"}, 1, ["a", "b", "c", "d"]),
    ],
)
def test_retention_counts_only_verified_backups(
    ids: list[str], verified: set[str], keep: int, doomed: list[str]
) -> None:
    assert retention.doomed(ids, verified, keep) == doomed


def test_prune_deletes_old_backups_and_only_old_unnamed_objects(tmp_path: Path) -> None:
    target = DirectoryTarget(tmp_path)
    manifests = {}
    for backup_id in ("01A", "01B", "01C"):
        blob = f"{backup_id}-{'0' * 60}"
        target.put(blob_name(blob), b"data")
        manifests[backup_id] = blob
        body = {
            "format": 1,
            "id": backup_id,
            "created_at": 1.0,
            "version": "0",
            "schema": 1,
            "revision": 1,
            "cluster_id": "",
            "entries": [{"kind": "state", "name": "state", "sha256": blob, "size": 4, "meta": {}}],
        }
        target.put(manifest_name(backup_id), json.dumps(body).encode())
        retention.mark_verified(target, backup_id)
    parse_manifest("01A", target.get(manifest_name("01A")) or b"")  # the test's manifests are real ones
    young_orphan = blob_name("f" * 64)
    target.put(young_orphan, b"being written by a backup in progress")
    now = time.time()
    old = now - retention.ORPHAN_GRACE - 60
    for backup_id in ("01A", "01B"):
        os.utime(tmp_path / blob_name(manifests[backup_id]), (old, old))

    pruned = retention.prune(target, keep=1, now=now)

    assert pruned.deleted == ["01A", "01B"] and pruned.kept == 1
    assert retention.backup_ids(target) == ["01C"]
    assert not target.exists(blob_name(manifests["01A"])) and not target.exists(blob_name(manifests["01B"]))
    assert target.exists(blob_name(manifests["01C"])), "an object the kept backup names is kept"
    assert target.exists(young_orphan), "a young unnamed object may belong to a backup in progress"
    assert pruned.objects_deleted == 2


def test_a_recipient_seals_without_the_passphrase_and_only_the_passphrase_opens() -> None:
    recipient = recovery.recipient(PASSPHRASE)
    assert PASSPHRASE.encode() not in recipient
    sealed = recovery.seal_to(b"the keyring", recipient)
    assert recovery.unseal(sealed, PASSPHRASE) == b"the keyring"
    with pytest.raises(recovery.WrongPassphrase):
        recovery.unseal(sealed, "another passphrase entirely")
    with pytest.raises(recovery.WeakPassphrase):
        recovery.recipient("short")


# ------------------------------------------------------------------ the loop on real components


async def _cluster(conn: Connection, view: StateView) -> tuple[ActionContext, Keyring]:
    await provision(conn.js, tombstone_ttl=900)
    key = PrivateKey.generate()
    record = pb.SecretsKey(key_id=key_id(public_bytes(key)), public_key=public_bytes(key))
    record.meta.id = CLUSTER_KEY
    writer = Writer(conn, view)
    await writer.commit(writer.txn().create(record))
    project = pb.Project(name="shop")
    project.meta.id = "01PROJ"
    await writer.commit(writer.txn().create(project))
    return ActionContext(conn, writer, "tester"), Keyring([key])


def _loop(conn: Connection, view: StateView, keyring: Keyring, clock: FakeClock) -> ScheduledBackups:
    loop = ScheduledBackups(LoopDeps(conn, view, clock, coalesce=0.0), lambda: keyring)
    loop.writer = Writer(conn, view)  # what a term's fenced writer does, without the lease
    return loop


async def _events(conn: Connection) -> list[pb.Event]:
    seen: list[pb.Event] = []

    async def got(msg: object) -> None:
        seen.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(f"{EVENTS_SUBJECT_PREFIX}>", cb=got)
    return seen


async def test_scheduled_backups_to_s3_use_only_sealed_credentials_and_keep_the_newest(
    s3: str, conn: Connection, view: StateView, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, keyring = await _cluster(conn, view)
    await schedule_backups(
        ctx, ScheduleBackups("@every 1h", f"s3://{BUCKET}/nightly", PASSPHRASE, 2, credentials_from_environment())
    )
    stored = view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID)
    assert isinstance(stored, pb.BackupSchedule) and stored.sealed_credentials
    raw = K.encode(stored)
    for plain in (SECRET_KEY, ACCESS_KEY, PASSPHRASE):
        assert plain.encode() not in raw, "the schedule holds no credential or passphrase in the clear"
    environment = {name: os.environ[name] for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID")}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)  # the service's process has none of the operator's environment

    clock = FakeClock(start=stored.meta.updated_at.ToNanoseconds() / 1e9)
    loop = _loop(conn, view, keyring, clock)
    await loop.run_pass()
    assert view.get(K.BACKUP_RUN, SCHEDULE_ID) is None, "nothing runs before the first slot"
    ids = []
    run = None
    for _ in range(3):
        await clock.advance(HOUR)
        await loop.run_pass()
        run = view.get(K.BACKUP_RUN, SCHEDULE_ID)
        assert isinstance(run, pb.BackupRun) and run.ok, run
        ids.append(run.backup_id)
    assert isinstance(run, pb.BackupRun) and len(set(ids)) == 3 and run.kept == 2 and run.deleted == 1

    credentials = {**environment, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}
    target = open_target(f"s3://{BUCKET}/nightly", credentials)
    assert retention.backup_ids(target) == ids[1:], "retention kept the two newest"
    manifest = parse_manifest(ids[-1], target.get(manifest_name(ids[-1])) or b"")
    sealed_key = next(e for e in manifest.entries if e.kind == SECRETS_KEY)
    opened = json.loads(recovery.unseal(target.get(blob_name(sealed_key.sha256)) or b"", PASSPHRASE))
    assert opened["keys"] == [bytes(keyring.current).hex()], "the passphrase opens the scheduled backup's key"
    status = backup_status(view)
    assert status.scheduled and not status.failing and status.last_backup_id == ids[-1]


async def test_a_failing_scheduled_backup_is_loud_until_a_later_one_succeeds(
    conn: Connection, view: StateView, tmp_path: Path
) -> None:
    ctx, keyring = await _cluster(conn, view)
    events = await _events(conn)
    place = tmp_path / "backups"
    await schedule_backups(ctx, ScheduleBackups("@every 1h", str(place), PASSPHRASE, 3))
    stored = view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID)
    assert isinstance(stored, pb.BackupSchedule)
    clock = FakeClock(start=stored.meta.updated_at.ToNanoseconds() / 1e9 + HOUR)
    loop = _loop(conn, view, keyring, clock)

    place.rmdir()
    place.write_text("a file where the backups should go")  # root ignores modes: a file makes it unwritable
    await loop.run_pass()
    status = backup_status(view)
    assert status.failing and status.failures == 1 and str(place) in status.error
    assert any("FAILING" in line for line in describe(status))
    await eventually(lambda: any(e.kind == "backup.failed" and str(place) in e.message for e in events), timeout=10)

    await clock.advance(30)
    await loop.run_pass()
    assert backup_status(view).failures == 1, "no retry before the backoff"

    place.unlink()
    await clock.advance(60)
    await loop.run_pass()
    status = backup_status(view)
    assert not status.failing and status.failures == 0 and status.last_backup_id and status.kept == 1
    assert not any("FAILING" in line for line in describe(status))
    assert retention.backup_ids(DirectoryTarget(place)) == [status.last_backup_id]

    await unschedule_backups(ctx, UnscheduleBackups())
    assert not backup_status(view).scheduled


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (ScheduleBackups("every day", "/tmp/b", PASSPHRASE), "schedule"),
        (ScheduleBackups("@daily", "/tmp/b", PASSPHRASE, keep=0), "keep"),
        (ScheduleBackups("@daily", "/tmp/b", "short"), "passphrase"),
        (ScheduleBackups("@daily", "ftp://host/b", PASSPHRASE), "target"),
    ],
)
async def test_a_bad_schedule_is_refused_naming_the_field(
    conn: Connection, view: StateView, request_: ScheduleBackups, field: str
) -> None:
    ctx, _ = await _cluster(conn, view)
    with pytest.raises(Invalid) as refused:
        await schedule_backups(ctx, request_)
    assert refused.value.field == field
    assert view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID) is None
