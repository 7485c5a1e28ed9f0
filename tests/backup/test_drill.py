"""The recovery drill on real components: a cluster's state on a real nats-server (projects, apps, an env
with a release, a sealed secret, a domain and its certificate, a console user, a source archive) backed up
to a real S3 API server (moto on loopback) and restored into a fresh nats-server; a corrupted or truncated
backup is named by ``verify`` and refused by ``restore`` before anything is written."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from nacl import pwhash
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions import backup_restore
from shared.actions.backup import CreateBackup, ListBackups, VerifyBackup, create_backup, list_backups, verify_backup
from shared.actions.backup_restore import RestoreBackup, restore_backup
from shared.actions.context import ActionContext
from shared.actions.refusals import Conflicting, Unavailable
from shared.backup import recovery
from shared.backup.cluster import read_state
from shared.backup.manifest import Corrupt, TooNew
from shared.backup.targets import TargetError
from shared.connection import Connection, connect
from shared.console_users import load_user, new_user, password_matches, save_user, users_bucket
from shared.embedded import EmbeddedNats
from shared.migrations.registry import SCHEMA
from shared.objects import read_object
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, Keyring, key_id, load_keyring, public_bytes, save_keyring, seal, unseal
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX, SOURCES_STORE
from shared.txn import Writer
from tests import factories
from tests.backup.conftest import BUCKET, SECRET_KEY

PASSPHRASE = "correct horse battery staple"
VALUE = "s3cr3t-api-token-value"
CERT_KEY = b"-----BEGIN PRIVATE KEY-----\nnot really a key\n-----END PRIVATE KEY-----\n"
HOST = "shop.example.test"
ENV = "01ENV"
SOURCE = os.urandom(200_000)


@pytest.fixture(autouse=True)
def quick_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    """libsodium's minimum Argon2id limits: the KDF's cost is not what these tests measure."""
    monkeypatch.setattr(recovery, "OPSLIMIT", pwhash.argon2id.OPSLIMIT_MIN)
    monkeypatch.setattr(recovery, "MEMLIMIT", pwhash.argon2id.MEMLIMIT_MIN)


@dataclass
class Cluster:
    conn: Connection
    view: StateView
    ctx: ActionContext
    keyring: Path


@contextlib.asynccontextmanager
async def cluster(url: str, data: Path) -> AsyncIterator[Cluster]:
    conn = await connect(url, name="backup-test")
    await provision(conn.js, tombstone_ttl=900)
    view = StateView(conn, name="backup-test")
    await view.start()
    try:
        yield Cluster(
            conn, view, ActionContext(conn, Writer(conn, view), "tester"), data / "control/secrets/cluster.key"
        )
    finally:
        await view.stop()
        await conn.close()


async def publish_key(c: Cluster) -> PrivateKey:
    """What the secrets service of a new cluster does: a key in its keyring file, its public half published."""
    key = PrivateKey.generate()
    c.keyring.parent.mkdir(parents=True, exist_ok=True)
    save_keyring(c.keyring, Keyring([key]))
    record = pb.SecretsKey(key_id=key_id(public_bytes(key)), public_key=public_bytes(key))
    record.meta.id = CLUSTER_KEY
    await c.ctx.writer.commit(c.ctx.writer.txn().create(record))
    return key


async def populate(c: Cluster) -> str:
    """The old cluster: returns its secrets key id."""
    key = await publish_key(c)
    kid = key_id(public_bytes(key))
    project = pb.Project(name="shop")
    project.meta.id = "01PROJ"
    app = pb.App(project_id="01PROJ", name="web")
    app.meta.id = "01APP"
    env = factories.env(ENV, project_id="01PROJ", app_id="01APP", active_release_id="01REL")
    release = factories.release("01REL", ENV)
    secret = pb.SealedSecret(environment_id=ENV, name="API_TOKEN", version=1, key_id=kid)
    secret.ciphertext = seal(public_bytes(key), VALUE.encode())
    secret.meta.id = "01SEC"
    domain = pb.Domain(environment_id=ENV, project_id="01PROJ", hostname=HOST)
    domain.meta.id = "01DOM"
    cert = pb.Certificate(hostname=HOST, chain_pem="-----BEGIN CERTIFICATE-----\nchain\n", key_id=kid)
    cert.sealed_key = seal(public_bytes(key), CERT_KEY)
    cert.meta.id = K.cert_id(HOST)
    txn = c.ctx.writer.txn()
    for msg in (project, app, env, release, secret, domain, cert, factories.node("01OLDNODE")):
        txn.create(msg)
    txn.create(factories.assignment("01OLDNODE", ENV, "01REL", assignment_id="01ASG"))
    lease = pb.Lease(holder="old-machine")
    txn.create(lease, key=K.lease("scheduler"))
    await c.ctx.writer.commit(txn)
    store = await c.conn.js.object_store(SOURCES_STORE)
    await store.put("01SRC", SOURCE)
    await users_bucket(c.conn.js, create=True)
    await save_user(c.conn.js, new_user("admin", "admin", "console-password-1", rounds=4))
    return kid


async def test_the_drill_s3_backup_restored_into_a_fresh_cluster(
    s3: str, nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = f"s3://{BUCKET}/prod"
    async with cluster(nats_url, tmp_path / "old") as old:
        kid = await populate(old)
        before = await read_state(old.conn)
        first = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
        second = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
    assert first.revision == before.revision and first.sent_bytes > len(SOURCE)
    # An unchanged cluster's second backup sends its manifest and the re-sealed key, not the objects again.
    assert second.sent_bytes < first.sent_bytes / 20, (first, second)
    listed = await list_backups(ListBackups(target))
    assert [b.id for b in listed] == sorted([first.id, second.id]) and not any(b.problem for b in listed)
    assert (await verify_backup(VerifyBackup(target))).id == max(first.id, second.id)

    # Nothing secret is stored in the clear: not the secret, not the passphrase, not the private keys.
    s3c = boto3.client("s3")
    stored = b"".join(
        s3c.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
        for o in s3c.list_objects_v2(Bucket=BUCKET)["Contents"]
    )
    old_key = load_keyring(old.keyring)
    assert old_key is not None
    for plain in (VALUE.encode(), PASSPHRASE.encode(), bytes(old_key.current).hex().encode(), CERT_KEY):
        assert plain not in stored

    async with cluster(nats_server.url, tmp_path / "new") as new:
        new_key = await publish_key(new)
        txn = new.ctx.writer.txn().create(factories.node("01NEWNODE"))
        await new.ctx.writer.commit(txn)
        request = RestoreBackup(target, "not the passphrase!", str(new.keyring))
        with pytest.raises(recovery.WrongPassphrase, match="recovery passphrase does not open"):
            await restore_backup(new.ctx, request)
        assert new.view.env(ENV) is None
        assert [bytes(k) for k in load_keyring(new.keyring).keys] == [bytes(new_key)]  # type: ignore[union-attr]

        restored = await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        assert restored.id == max(first.id, second.id) and restored.objects == 1 and restored.console_users == 1
        after = await read_state(new.conn)
        left_behind = {"node.01OLDNODE", "assignment.01OLDNODE.01ASG", "lease.scheduler"}
        for key, data in before.values.items():
            if key not in left_behind:
                assert after.values.get(key) == data, key
        assert not left_behind & set(after.values) and "node.01NEWNODE" in after.values
        keyring = load_keyring(new.keyring)
        assert keyring is not None and keyring.by_id(kid) is not None and keyring.keys[1] == new_key
        secret = pb.SealedSecret.FromString(after.values["secret.01SEC"])
        assert unseal(keyring.by_id(secret.key_id), secret.ciphertext).decode() == VALUE  # type: ignore[arg-type]
        cert = pb.Certificate.FromString(after.values[K.cert(HOST)])
        assert unseal(keyring.by_id(cert.key_id), cert.sealed_key) == CERT_KEY  # type: ignore[arg-type]
        assert await read_object(new.conn.js, SOURCES_STORE, "01SRC") == SOURCE
        user = await load_user(new.conn.js, "admin")
        assert user is not None and password_matches(user, "console-password-1")

        with pytest.raises(Conflicting, match=r"the cluster is not empty .*--force"):
            await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        forced = await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring), force=True))
        assert forced.keys == restored.keys


async def test_a_corrupted_or_truncated_backup_is_named_and_refused(
    s3: str, nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = f"s3://{BUCKET}"
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        created = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
    s3c = boto3.client("s3")
    manifest = json.loads(s3c.get_object(Bucket=BUCKET, Key=f"backups/{created.id}/manifest.json")["Body"].read())
    digest = next(e["sha256"] for e in manifest["entries"] if e["name"] == "01SRC")
    s3c.put_object(Bucket=BUCKET, Key=f"blobs/{digest}", Body=SOURCE[:1000])
    with pytest.raises(Corrupt, match=r"object sources/01SRC is 1000 bytes, expected 200000 \(truncated\?\)"):
        await verify_backup(VerifyBackup(target, created.id))
    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        with pytest.raises(Corrupt, match="object sources/01SRC"):
            await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        assert (await read_state(new.conn)).values.keys() == {"secretskey.cluster"}
        flipped = bytearray(SOURCE)
        flipped[7] ^= 1
        s3c.put_object(Bucket=BUCKET, Key=f"blobs/{digest}", Body=bytes(flipped))
        altered = r"object sources/01SRC does not match its SHA-256 \(altered\)"
        with pytest.raises(Corrupt, match=altered):
            await verify_backup(VerifyBackup(target, created.id))
        with pytest.raises(Corrupt, match=altered):
            await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        assert new.view.env(ENV) is None


async def test_a_failed_backup_is_an_event_and_names_the_cause(
    s3: str, conn: Connection, tmp_path: Path, view: StateView
) -> None:
    c = Cluster(conn, view, ActionContext(conn, Writer(conn, view), "tester"), tmp_path / "control/secrets/cluster.key")
    await publish_key(c)
    seen: list[pb.Event] = []

    async def on_event(msg: object) -> None:
        seen.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    sub = await conn.nc.subscribe(EVENTS_SUBJECT_PREFIX + ">", cb=on_event)
    with pytest.raises(TargetError, match=r"s3://no-such-bucket: NoSuchBucket: bucket no-such-bucket does not exist"):
        await create_backup(c.ctx, CreateBackup("s3://no-such-bucket", PASSPHRASE, str(c.keyring)))
    await conn.nc.flush()
    await sub.unsubscribe()
    failed = [e for e in seen if e.kind == "backup.failed"]
    assert failed and "NoSuchBucket" in failed[0].message and SECRET_KEY not in failed[0].message


async def test_a_backup_from_a_newer_schema_is_refused(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    target = str(tmp_path / "backups")
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        created = await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
    path = tmp_path / "backups" / "backups" / created.id / "manifest.json"
    doc = json.loads(path.read_text())
    doc["schema"] = SCHEMA + 1
    path.write_text(json.dumps(doc))
    assert (await verify_backup(VerifyBackup(target))).id == created.id
    async with cluster(nats_server.url, tmp_path / "new") as new:
        await publish_key(new)
        with pytest.raises(TooNew, match=f"taken at schema {SCHEMA + 1}.*upgrade Zattera"):
            await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))


async def test_a_restore_waits_for_the_clusters_secrets_service(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = str(tmp_path / "backups")
    async with cluster(nats_url, tmp_path / "old") as old:
        await populate(old)
        await create_backup(old.ctx, CreateBackup(target, PASSPHRASE, str(old.keyring)))
    monkeypatch.setattr(backup_restore, "KEY_PUBLISHED_WAIT", 0.0)
    async with cluster(nats_server.url, tmp_path / "new") as new:
        with pytest.raises(Unavailable, match=r"secrets service published no key.*Nothing was restored"):
            await restore_backup(new.ctx, RestoreBackup(target, PASSPHRASE, str(new.keyring)))
        assert (await read_state(new.conn)).values == {} and not new.keyring.exists()
