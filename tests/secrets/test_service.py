"""The secrets service on a real NATS server: the cluster key, who may open what, and key rotation.

The service runs in-process on its own connection and view; requests go over NATS exactly as an agent's
(``shared.secrets.fetch_secrets``). Node key pairs are made here, as agents make theirs at registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.secrets.service import SecretsService
from shared import keys as K
from shared.backup.sealed import open_settings, seal_settings
from shared.connection import Connection, connect
from shared.ids import new_id
from shared.secrets import (
    CLUSTER_KEY,
    ROTATE_SUBJECT,
    SecretsServiceSilent,
    SecretsUnavailable,
    fetch_secrets,
    load_keyring,
    public_bytes,
    seal,
    unseal,
)
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests import factories
from tests.waiting import eventually

VALUE = "correct horse battery staple"


@dataclass
class Running:
    service: SecretsService
    path: Path
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def secrets_service(nats_url: str, path: Path, *, seed: str = "") -> AsyncIterator[Running]:
    conn = await connect(nats_url, name="secrets-under-test")
    view = StateView(conn, name="secrets")
    await view.start()
    service = SecretsService(conn, view, Writer(conn, view), keyring_path=path, seed_key=seed, open_wait=0.3)
    task = asyncio.create_task(service.run())
    try:
        await eventually(lambda: service.serving.is_set() or task.done(), 10, "the service is serving")
        yield Running(service, path, task)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await view.stop()
        await conn.close()


@dataclass
class Placed:
    assignment_id: str
    env_id: str
    keys: dict[str, PrivateKey]


async def place_with_secret(view: StateView, writer: Writer) -> Placed:
    """Nodes n1 and n2 (each with its key), an env whose release uses API_TOKEN, one replica on n1."""
    await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the cluster key published")
    published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    assert isinstance(published, pb.SecretsKey)
    keys = {n: PrivateKey.generate() for n in ("n1", "n2")}
    txn = writer.txn()
    for name, key in keys.items():
        node = factories.node(name)
        node.secrets_public_key = public_bytes(key)
        txn.create(node)
    env = factories.env("E1")
    sealed = pb.SealedSecret(
        environment_id="E1",
        name="API_TOKEN",
        version=1,
        ciphertext=seal(published.public_key, VALUE.encode()),
        key_id=published.key_id,
    )
    sealed.meta.id = new_id()
    release = factories.release("R1", "E1")
    release.service.secrets["API_TOKEN"].secret_id = sealed.meta.id
    release.service.secrets["API_TOKEN"].version = 1
    release.service.vars["PLAIN"] = "not secret"
    assignment = factories.assignment("n1", "E1", "R1", assignment_id="A1")
    txn.create(env).create(sealed).create(release).create(assignment)
    await writer.commit(txn)
    return Placed("A1", "E1", keys)


async def test_the_node_running_an_assignment_opens_its_secrets_and_no_other_node_can(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    async with secrets_service(nats_url, tmp_path / "secrets" / "cluster.key") as running:
        assert stat.S_IMODE(running.path.stat().st_mode) == 0o600
        placed = await place_with_secret(view, writer)
        values = await fetch_secrets(conn, "n1", placed.keys["n1"], placed.assignment_id)
        assert values == {"API_TOKEN": VALUE}  # only secrets: plain vars travel in the release

        events = await conn.nc.subscribe(EVENTS_SUBJECT_PREFIX + "secrets.refused")
        with pytest.raises(SecretsUnavailable, match="assignment A1 is not placed on node n2"):
            await fetch_secrets(conn, "n2", placed.keys["n2"], placed.assignment_id)
        event = pb.Event.FromString((await events.next_msg(timeout=5)).data)
        assert event.node_id == "n2" and event.severity == "warning" and "A1" in event.message
        assert VALUE not in event.message
        # A request for n1 with any other key than n1's registered one (e.g. a stolen credential).
        with pytest.raises(SecretsUnavailable, match="not the one registered"):
            await fetch_secrets(conn, "n1", PrivateKey.generate(), placed.assignment_id)
        # A request that names n1 on n2's subject.
        forged = cpb.OpenSecretsRequest(
            node_id="n1", assignment_id="A1", node_public_key=public_bytes(placed.keys["n1"])
        )
        reply = await conn.nc.request("zattera.secrets.n2.open", forged.SerializeToString(), timeout=5)
        answer = cpb.OpenSecretsResponse.FromString(reply.data)
        assert not answer.sealed and "came on node n2's subject" in answer.error

        # An assignment being stopped gets nothing either.
        stopping = pb.Assignment()
        stopping.CopyFrom(view.assignment("A1"))  # type: ignore[arg-type]
        stopping.desired = pb.ASSIGNMENT_DESIRED_STOP
        await writer.commit(writer.txn().put(stopping))
        with pytest.raises(SecretsUnavailable, match="not desired running"):
            await fetch_secrets(conn, "n1", placed.keys["n1"], placed.assignment_id)


async def test_a_node_that_re_registered_with_a_new_key_is_answered_once_the_view_shows_it(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    async with secrets_service(nats_url, tmp_path / "cluster.key"):
        placed = await place_with_secret(view, writer)
        rotated = PrivateKey.generate()
        node = pb.Node()
        node.CopyFrom(view.node("n1"))  # type: ignore[arg-type]
        node.secrets_public_key = public_bytes(rotated)
        fetching = asyncio.create_task(fetch_secrets(conn, "n1", rotated, placed.assignment_id))
        await writer.commit(writer.txn().put(node))
        assert await fetching == {"API_TOKEN": VALUE}
        with pytest.raises(SecretsUnavailable, match="not the one registered"):
            await fetch_secrets(conn, "n1", placed.keys["n1"], placed.assignment_id)


async def test_rotation_reseals_every_secret_and_the_old_key_is_gone(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.key"
    async with secrets_service(nats_url, path):
        placed = await place_with_secret(view, writer)
        old_keyring = load_keyring(path)
        assert old_keyring is not None
        (before,) = view.secrets(placed.env_id)
        old_ciphertext = before.ciphertext

        reply = await conn.nc.request(ROTATE_SUBJECT, cpb.RotateSecretsKeyRequest().SerializeToString(), timeout=30)
        rotated = cpb.RotateSecretsKeyResponse.FromString(reply.data)
        assert not rotated.error and rotated.resealed == 1 and rotated.key_id != rotated.previous_key_id

        new_keyring = load_keyring(path)
        assert new_keyring is not None and len(new_keyring.keys) == 1
        new_key = new_keyring.current
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        await eventually(lambda: view.secrets(placed.env_id)[0].key_id == rotated.key_id, 10, "re-sealed")
        (after,) = view.secrets(placed.env_id)
        assert unseal(new_key, after.ciphertext) == VALUE.encode()
        with pytest.raises(CryptoError):
            unseal(new_key, old_ciphertext)  # the old ciphertext is unreadable with the new key alone
        published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
        assert isinstance(published, pb.SecretsKey) and published.key_id == rotated.key_id
        assert await fetch_secrets(conn, "n1", placed.keys["n1"], placed.assignment_id) == {"API_TOKEN": VALUE}


async def test_rotation_reseals_a_volumes_off_site_settings(
    nats_url: str, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.key"
    settings = {"AWS_SECRET_ACCESS_KEY": "off-site-secret"}
    async with secrets_service(nats_url, path) as running:
        await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the key is published")
        sealed = seal_settings(view, settings)
        volume = pb.Volume(name="data", project_id="P", environment_id="E")
        volume.meta.id = "V1"
        volume.snapshot_policy.offsite_target = "s3://b/p"
        volume.snapshot_policy.offsite_sealed_settings = sealed.sealed
        volume.snapshot_policy.offsite_key_id = sealed.key_id
        await writer.commit(writer.txn().create(volume))
        rotated = await running.service.rotate()
        assert not rotated.error and rotated.resealed == 1 and rotated.previous_key_id == sealed.key_id

        def policy() -> pb.SnapshotPolicy:
            found = view.volume("V1")
            assert found is not None
            return found.snapshot_policy

        await eventually(lambda: policy().offsite_key_id == rotated.key_id, 10, "re-sealed")
        keyring = load_keyring(path)
        assert policy().offsite_target == "s3://b/p"
        assert open_settings(keyring, policy().offsite_sealed_settings, policy().offsite_key_id) == settings


async def test_a_replica_without_the_published_key_serves_nothing_and_never_replaces_it(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    """A replica without the cluster key leaves the requests to those that hold it: beside one that holds it,
    every request is served (before, it answered "no key" to its share of them)."""
    async with secrets_service(nats_url, tmp_path / "first.key"):
        placed = await place_with_secret(view, writer)
    published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    async with secrets_service(nats_url, tmp_path / "other.key") as running:
        assert running.service.keyring is None
        with pytest.raises(SecretsServiceSilent):
            await fetch_secrets(conn, "n1", placed.keys["n1"], placed.assignment_id, timeout=1.0)
        async with secrets_service(nats_url, tmp_path / "first.key"):
            for _ in range(20):
                assert await fetch_secrets(conn, "n1", placed.keys["n1"], placed.assignment_id)
        assert view.get(K.SECRETS_KEY, CLUSTER_KEY) == published
        assert not (tmp_path / "other.key").exists()


async def test_a_seed_key_from_the_environment_is_the_cluster_key(
    nats_url: str, view: StateView, tmp_path: Path
) -> None:
    seed = PrivateKey.generate()
    async with secrets_service(nats_url, tmp_path / "cluster.key", seed=bytes(seed).hex()):
        await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10)
        published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
        assert isinstance(published, pb.SecretsKey) and published.public_key == public_bytes(seed)


async def test_replicas_sharing_the_key_file_both_answer_after_a_rotation(
    nats_url: str, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.key"
    async with secrets_service(nats_url, path) as first, secrets_service(nats_url, path) as second:
        placed = await place_with_secret(view, writer)
        rotated = await first.service.rotate()
        assert not rotated.error and rotated.resealed == 1
        await eventually(lambda: view.secrets(placed.env_id)[0].key_id == rotated.key_id, 10, "re-sealed")
        # The second replica still holds only the old key in memory: it re-reads the shared file.
        await eventually(
            lambda: (
                second.service.view.get(K.SECRET, view.secrets(placed.env_id)[0].meta.id).key_id  # type: ignore[union-attr]
                == rotated.key_id
            ),
            10,
            "the second replica's view has the re-sealed version",
        )
        release = view.release("R1")
        assert release is not None
        assert second.service.open_values(release) == {"API_TOKEN": VALUE}
        assert first.service.open_values(release) == {"API_TOKEN": VALUE}
