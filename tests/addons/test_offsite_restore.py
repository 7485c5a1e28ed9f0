"""A managed database restored from its off-site copy when its node's ``backups`` volume is gone, on real
components: a real nats-server, the S3 API server (moto), a real snapshot agent, the off-site copy loop,
and — for the server side — the add-on's entry script on the real PostgreSQL and pgBackRest.

``addons offsite`` sets the database's ``backups`` volume's snapshot policy (schedule and target, the
settings sealed); each snapshot goes to the target; with the volume's files, every local snapshot object
and the snapshot record gone, ``addons restore --from TARGET`` fetches the copy back, restores it into the
fork's OWN new ``backups`` volume on a live node, then writes the fork, which restores from it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.handlers import SnapshotAgent
from services.secrets.offsite import OffsiteSnapshots
from shared import keys as K
from shared.actions.addon_restore import restore_addon, set_addon_offsite
from shared.actions.addons import AddonOffsite, CreateAddon, RestoreAddon, addon_info, create_addon
from shared.actions.refusals import Invalid, NotFound
from shared.actions.volumes import TakeSnapshot, take_snapshot
from shared.addons import spec as addon
from shared.backup.offsite import offsite_ids
from shared.backup.targets import credentials_from_environment, open_target
from shared.clock import FakeClock
from shared.loop import LoopDeps
from shared.secrets import load_keyring
from shared.snapshots.store import SnapshotStore
from tests import factories
from tests.addons.pgserver import UID, PgInstance, require_servers
from tests.backup.conftest import ACCESS_KEY, BUCKET, SECRET_KEY, s3
from tests.backup.test_drill import Cluster, cluster, publish_key

__all__ = ["s3"]  # the S3 server fixture of the backup tests

NODE = "01NODE1"


@contextlib.asynccontextmanager
async def _cluster_with_database(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[Cluster, Path, str]]:
    """A cluster (secrets key, project shop, node NODE with its snapshot agent) and database ``orders``
    whose ``backups`` volume is placed on NODE: yields the cluster, the volumes root and that volume's id."""
    async with cluster(nats_url, tmp_path / "c") as c:
        await publish_key(c)
        project = pb.Project(name="shop")
        project.meta.id = "01PROJ"
        await c.ctx.writer.commit(c.ctx.writer.txn().create(project).create(factories.node(NODE)))
        created = await create_addon(c.ctx, CreateAddon("postgres", "orders", "shop"))
        backups = pb.Volume(
            project_id="01PROJ",
            environment_id=created.info.env_id,
            name=addon.BACKUPS_VOLUME,
            node_id=NODE,
            status=pb.VOLUME_STATUS_ACTIVE,
        )
        backups.meta.id = "01BACKUPSVOL"
        await c.ctx.writer.commit(c.ctx.writer.txn().create(backups))
        root = tmp_path / "volumes"
        agent = SnapshotAgent(c.conn, NODE, root)
        await agent.start()
        try:
            yield c, root, backups.meta.id
        finally:
            await agent.stop()


def _repo(volume: Path) -> dict[str, bytes]:
    """A pgBackRest repository's shape (what the volume's snapshot must carry)."""
    files = {
        "repo/backup/orders/backup.info": b"[backup:current]\n" + os.urandom(64).hex().encode(),
        "repo/archive/orders/15-1/000000010000000000000001-abc.zst": os.urandom(300_000),
        "repo/archive/orders/archive.info": b"[db]\ndb-id=1\n",
        "pgbackrest.conf": b"[global]\nrepo1-path=/old/node/path\n",
    }
    for name, data in files.items():
        (volume / name).parent.mkdir(parents=True, exist_ok=True)
        (volume / name).write_bytes(data)
    return files


async def test_backups_go_off_site_and_a_fork_comes_back_from_there_when_the_volume_is_gone(
    s3: str, nats_url: str, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/offsite"
    settings = credentials_from_environment()
    async with _cluster_with_database(nats_url, tmp_path) as (c, root, volume_id):
        files = _repo(root / volume_id)
        # bad input first: naming the field
        with pytest.raises(Invalid) as bad:
            await set_addon_offsite(c.ctx, AddonOffsite("orders", "shop", "s3://no-such-bucket/x", settings=settings))
        assert bad.value.field == "offsite"
        with pytest.raises(NotFound, match="holds no off-site snapshot") as none:
            await restore_addon(c.ctx, RestoreAddon("orders", "shop", "copy", None, source=url, settings=settings))
        assert none.value.field == "source"

        done = await set_addon_offsite(c.ctx, AddonOffsite("orders", "shop", url, "@every 30m", settings=settings))
        assert (done.volume_id, done.offsite, done.schedule) == (volume_id, url, "@every 30m")
        assert addon_info(c.view, "orders", "shop").offsite == f"{url} @every 30m"
        volume = c.view.volume(volume_id)
        raw = K.encode(volume) if volume is not None else b""
        assert raw and SECRET_KEY.encode() not in raw and ACCESS_KEY.encode() not in raw, "settings stored sealed"
        taken = await take_snapshot(c.ctx, TakeSnapshot(volume_id))
        assert taken.status == "COMPLETE", taken
        keyring = load_keyring(c.keyring)
        assert keyring is not None
        await OffsiteSnapshots(LoopDeps(c.conn, c.view, FakeClock(), coalesce=0.0), lambda: keyring).run_pass()
        assert offsite_ids(open_target(url, settings), volume_id) == [taken.snapshot_id]

        # The node's backups are gone: the volume's files, every local snapshot object, the record.
        shutil.rmtree(root / volume_id)
        store = await SnapshotStore.open(c.conn.js)
        for obj in await store.list(""):
            await store.delete(obj.name)
        await c.ctx.writer.commit(c.ctx.writer.txn().delete(K.snapshot(taken.snapshot_id)))

        with pytest.raises(Invalid, match="after the newest off-site copy") as late:
            at = c.ctx.clock.now()  # after the copy was taken
            await restore_addon(c.ctx, RestoreAddon("orders", "shop", "copy", at, source=url, settings=settings))
        assert late.value.field == "to_time"

        forked = await restore_addon(c.ctx, RestoreAddon("orders", "shop", "copy", None, source=url, settings=settings))
        env = c.view.env(forked.info.env_id)
        assert env is not None
        assert env.service.vars[addon.FORK_SNAPSHOT_VAR] == taken.snapshot_id
        assert addon.FORK_VOLUME_VAR not in env.service.vars  # nothing to copy from the origin's node
        assert env.service.vars["ZATTERA_PG_RESTORE_STANZA"] == "orders"
        assert env.service.vars["ZATTERA_PG_RESTORE_TARGET"] == "latest"
        assert forked.info.restored_from == "shop/orders"
        fork_volumes = {v.name: v for v in c.view.volumes(env.meta.id)}
        assert set(fork_volumes) == {"data", "backups"}
        assert {v.node_id for v in fork_volumes.values()} == {NODE}
        assert fork_volumes["backups"].status == pb.VOLUME_STATUS_ACTIVE
        restored = root / fork_volumes["backups"].meta.id
        for name, data in files.items():
            assert (restored / name).read_bytes() == data, name
        assert not (root / volume_id).exists(), "the origin's volume is not written"
        assert c.view.snapshot(taken.snapshot_id) is not None  # its record back

        # a name in use: refused before anything is fetched or created
        with pytest.raises(Exception, match="already an app") as taken_name:
            await restore_addon(c.ctx, RestoreAddon("orders", "shop", "copy", None, source=url, settings=settings))
        assert getattr(taken_name.value, "field", "") == "as_name"


# --- the server's side: the fork's entry script restores from a backups volume restored from a snapshot ----


@pytest.fixture
def pgroot() -> Iterator[Path]:
    require_servers()
    path = Path(tempfile.mkdtemp(prefix="zattera-offsite-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _chown_tree(path: Path) -> None:
    for dirpath, dirs, names in os.walk(path):
        for name in (*dirs, *names):
            os.chown(os.path.join(dirpath, name), UID, UID, follow_symlinks=False)
    os.chown(path, UID, UID)


def test_a_fork_restores_from_a_backups_volume_copied_whole_from_the_origin(pgroot: Path) -> None:
    origin = PgInstance(pgroot / "origin", "orders")
    origin.start()
    fork: PgInstance | None = None
    try:
        origin.sql("create table t(x int primary key)")
        origin.sql("insert into t select generate_series(1, 300)")
        origin.archived_through_current()
        origin.stop()
        # what the snapshot engine restores into the fork's backups volume: the origin's WHOLE volume
        fork = PgInstance(
            pgroot / "fork",
            "copy",
            extra={
                addon.FORK_SNAPSHOT_VAR: "01SNAP",
                "ZATTERA_PG_RESTORE_STANZA": "orders",
                "ZATTERA_PG_RESTORE_TARGET": "latest",
            },
        )
        fork.root.mkdir()
        shutil.copytree(origin.backups, fork.backups, symlinks=True)
        _chown_tree(fork.backups)
        shutil.rmtree(origin.root)  # the origin's node is gone
        fork.start(timeout=180)
        assert fork.sql("select count(*), max(x) from t") == ["300|300"]
        assert not (fork.backups / addon.ORIGIN_REPO_DIR).exists()
        assert (fork.backups / "repo" / "backup" / "copy").is_dir()  # its own stanza, its own first backup
        assert "/origin/" not in (fork.backups / "pgbackrest.conf").read_text()
        for secret in (origin.superuser_password, origin.app_password):
            assert secret not in fork.log.read_text()
    finally:
        origin.stop()
        if fork is not None:
            fork.stop()
