"""The local CA in a backup, on real components (two nats-servers, a directory target): carried sealed with the
keyring (to the passphrase, and to the recipient of scheduled backups), put back by a restore into the new
machine's certs directory, where the certs service's CA file reader issues from it without a restart; a
backup taken without a CA restores with the new machine's CA left as it is."""

from __future__ import annotations

import datetime
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from nacl import pwhash
from zattera.v1 import types_pb2 as pb

from services.certs.localca import LocalCAFile, load_or_create
from services.secrets.backups import ScheduledBackups
from shared import keys as K
from shared import localca
from shared.actions.backup import CreateBackup, create_backup
from shared.actions.backup_restore import RestoreBackup, restore_backup
from shared.actions.backup_schedule import ScheduleBackups, schedule_backups
from shared.actions.refusals import Invalid
from shared.backup import recovery
from shared.backup.cluster import read_state
from shared.backup.status import SCHEDULE_ID
from shared.backup.targets import DirectoryTarget
from shared.clock import FakeClock
from shared.embedded import EmbeddedNats
from shared.loop import LoopDeps
from shared.secrets import load_keyring
from shared.security.tls import pem_key
from tests.backup.test_drill import PASSPHRASE, cluster, populate, publish_key
from tests.certs.test_local_ca import issued_by
from tests.eventlog import stored_events

HOST = "notes.localhost"


@pytest.fixture(autouse=True)
def quick_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    """libsodium's minimum Argon2id limits: the KDF's cost is not what these tests measure."""
    monkeypatch.setattr(recovery, "OPSLIMIT", pwhash.argon2id.OPSLIMIT_MIN)
    monkeypatch.setattr(recovery, "MEMLIMIT", pwhash.argon2id.MEMLIMIT_MIN)


def stored_bytes(target: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(target.rglob("*")) if p.is_file())


def private_pem(directory: Path) -> bytes:
    """The CA key alone, as PKCS8 PEM (how it sits in the key file)."""
    key = serialization.load_pem_private_key((directory / localca.CA_KEY_FILE).read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return pem_key(key).encode()


async def test_the_local_ca_is_restored_sealed_and_the_certs_service_issues_from_it(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = tmp_path / "backups"
    old_ca_dir, new_ca_dir = tmp_path / "old/control/certs", tmp_path / "new/control/certs"
    old_ca = load_or_create(old_ca_dir)
    old_pem = (old_ca_dir / localca.CA_CERT_FILE).read_text()
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        await create_backup(
            old.ctx, CreateBackup(str(target), PASSPHRASE, str(old.keyring), local_ca_dir=str(old_ca_dir))
        )
    stored = stored_bytes(target)
    key_pem = private_pem(old_ca_dir)
    key_body = b"".join(key_pem.splitlines()[1:-1])
    assert key_body not in stored and key_pem not in stored, "the CA key is in the backup sealed only"

    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        serving = LocalCAFile(new_ca_dir)  # the new machine's certs service: made its own CA at `zattera up`
        before_restore, _ = serving.issue("early.localhost", 1.8e9)
        assert not issued_by(before_restore, old_pem)

        wrong = RestoreBackup(str(target), "not the passphrase!", str(new.keyring), local_ca_dir=str(new_ca_dir))
        with pytest.raises(recovery.WrongPassphrase):
            await restore_backup(new.ctx, wrong)
        assert (new_ca_dir / localca.CA_CERT_FILE).read_text() != old_pem, "nothing written before the checks"

        request = RestoreBackup(str(target), PASSPHRASE, str(new.keyring), local_ca_dir=str(new_ca_dir))
        restored = await restore_backup(new.ctx, request)
        assert restored.local_ca == localca.fingerprint(localca.parse((old_ca_dir / localca.CA_KEY_FILE).read_bytes()))
        assert not any("local CA" in note for note in restored.skipped), restored.skipped
        assert (new_ca_dir / localca.CA_CERT_FILE).read_text() == old_pem
        assert (new_ca_dir / localca.CA_KEY_FILE).read_bytes() == (old_ca_dir / localca.CA_KEY_FILE).read_bytes()
        assert stat.S_IMODE((new_ca_dir / localca.CA_KEY_FILE).stat().st_mode) == 0o600
        # The running service's reader sees the new file at its next issue: no restart.
        chain, _ = serving.issue(HOST, 1.8e9)
        assert issued_by(chain, old_pem) and serving.current.cert == old_ca.cert
        # The fingerprint is public; nothing of the key went into the state or the result.
        state = await read_state(new.conn)
        assert key_body not in b"".join(state.values.values())
        assert key_body.decode() not in json.dumps(restored.__dict__)
        events = [e for e in await stored_events(new.conn) if e.kind == "backup.restored"]
        assert [e.message.endswith(", the local CA") for e in events] == [True], events
        assert not any(key_body.decode() in e.message + json.dumps(dict(e.fields)) for e in events)


async def test_a_scheduled_backup_carries_the_local_ca_sealed_to_the_recipient(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = tmp_path / "nightly"
    old_ca_dir, new_ca_dir = tmp_path / "old/control/certs", tmp_path / "new/control/certs"
    load_or_create(old_ca_dir)
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        await schedule_backups(old.ctx, ScheduleBackups("@every 1h", str(target), PASSPHRASE, 2))
        keyring = load_keyring(old.keyring)
        clock = FakeClock(start=datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC).timestamp())
        loop = ScheduledBackups(
            LoopDeps(old.conn, old.view, clock, coalesce=0.0), lambda: keyring, local_ca_dir=old_ca_dir
        )
        loop.writer = old.ctx.writer
        schedule = old.view.get(K.BACKUP_SCHEDULE, SCHEDULE_ID)
        assert isinstance(schedule, pb.BackupSchedule)
        run = await loop.run_backup(schedule, None)
        assert run.ok, run
    assert private_pem(old_ca_dir).splitlines()[1] not in stored_bytes(target)
    assert DirectoryTarget(target).exists(f"backups/{run.backup_id}/manifest.json")

    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        load_or_create(new_ca_dir)
        request = RestoreBackup(str(target), PASSPHRASE, str(new.keyring), local_ca_dir=str(new_ca_dir))
        restored = await restore_backup(new.ctx, request)
    assert (
        restored.local_ca
        and (new_ca_dir / localca.CA_KEY_FILE).read_bytes() == (old_ca_dir / localca.CA_KEY_FILE).read_bytes()
    )


async def test_a_backup_without_a_local_ca_restores_and_the_new_ca_stays(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = tmp_path / "backups"
    new_ca_dir = tmp_path / "new/control/certs"
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        await create_backup(old.ctx, CreateBackup(str(target), PASSPHRASE, str(old.keyring)))  # as before
    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        load_or_create(new_ca_dir)
        own = (new_ca_dir / localca.CA_KEY_FILE).read_bytes()
        request = RestoreBackup(str(target), PASSPHRASE, str(new.keyring), local_ca_dir=str(new_ca_dir))
        restored = await restore_backup(new.ctx, request)
    assert restored.local_ca == "" and restored.keys > 0
    assert any(note.startswith("the local CA: the backup holds none") for note in restored.skipped)
    assert (new_ca_dir / localca.CA_KEY_FILE).read_bytes() == own


async def test_a_local_ca_that_is_not_one_is_refused_before_anything_is_written(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    old_ca_dir = tmp_path / "old/control/certs"
    load_or_create(old_ca_dir)
    other = load_or_create(tmp_path / "other")
    key_file = old_ca_dir / localca.CA_KEY_FILE
    key_file.write_bytes(
        key_file.read_bytes().split(b"-----BEGIN CERTIFICATE")[0] + other.cert.public_bytes(serialization.Encoding.PEM)
    )
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        request = CreateBackup(str(tmp_path / "b"), PASSPHRASE, str(old.keyring), local_ca_dir=str(old_ca_dir))
        with pytest.raises(Invalid, match=r"certs: local CA: the key does not belong to the certificate") as refused:
            await create_backup(old.ctx, request)
    assert refused.value.field == "local_ca_dir"
    assert not (tmp_path / "b" / "backups").exists()
