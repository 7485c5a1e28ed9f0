"""The Redis add-on's BGSAVE pre-hook is set by the platform: a snapshot of a Redis database's ``data``
volume whose policy names no hook runs ``sh zattera-bgsave.sh`` first (shared/addons/spec.py,
shared/snapshots/dispatch.py), on real components — a real nats-server, the snapshot dispatcher and a real
snapshot agent running the hook in the volume, next to the real Redis server of the add-on's entry
script: the snapshot holds a ``dump.rdb`` with the key written just before. A policy's own hook wins; a
PostgreSQL database's volumes get none; with no server running the hook returns at once."""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.handlers import SnapshotAgent, run_hook_in_shell
from shared.actions.addons import CreateAddon, create_addon
from shared.actions.volumes import SetSnapshotPolicy, TakeSnapshot, set_snapshot_policy, take_snapshot
from shared.addons import spec as addon
from shared.snapshots.store import SnapshotStore
from tests import factories
from tests.addons.test_redis_engine import RedisInstance
from tests.backup.test_drill import Cluster, cluster, publish_key

NODE = "01NODE1"


@pytest.fixture
def redis() -> Iterator[RedisInstance]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make install-system)")
    root = Path(tempfile.mkdtemp(prefix="zattera-redis-hook-"))
    root.chmod(0o755)
    instance = RedisInstance(root / "r")
    yield instance
    instance.stop(signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def _cluster(nats_url: str, tmp_path: Path, volumes_root: Path) -> AsyncIterator[tuple[Cluster, list[str]]]:
    """Project shop, node NODE with its snapshot agent (the hooks it ran are recorded, then run)."""
    ran: list[str] = []

    async def hook(command: str, assignment_id: str, directory: Path) -> None:
        ran.append(command)
        await run_hook_in_shell(command, assignment_id, directory)

    async with cluster(nats_url, tmp_path / "c") as c:
        await publish_key(c)
        project = pb.Project(name="shop")
        project.meta.id = "01PROJ"
        await c.ctx.writer.commit(c.ctx.writer.txn().create(project).create(factories.node(NODE)))
        agent = SnapshotAgent(c.conn, NODE, volumes_root, hook_runner=hook)
        await agent.start()
        try:
            yield c, ran
        finally:
            await agent.stop()


async def _placed(c: Cluster, engine: str, name: str, volume_id: str) -> str:
    """Database ``name`` with its replica running on NODE and its ``data`` volume ``volume_id`` there."""
    created = await create_addon(c.ctx, CreateAddon(engine, name, "shop"))
    env_id = created.info.env_id
    volume = pb.Volume(
        project_id="01PROJ", environment_id=env_id, name=addon.DATA_VOLUME, node_id=NODE, status=pb.VOLUME_STATUS_ACTIVE
    )
    volume.meta.id = volume_id
    running = factories.assignment(NODE, env_id, "01REL", assignment_id=f"01ASG{volume_id}")
    await c.ctx.writer.commit(c.ctx.writer.txn().create(volume).create(running))
    return env_id


async def test_a_redis_data_snapshot_runs_the_bgsave_hook_the_platform_sets(
    nats_url: str, tmp_path: Path, redis: RedisInstance
) -> None:
    redis.start()
    # the agent's volumes root: the Redis data directory is volume "data" there
    async with _cluster(nats_url, tmp_path, redis.root) as (c, ran):
        await _placed(c, addon.REDIS, "cache", "data")
        volume = c.view.volume("data")
        assert volume is not None and volume.snapshot_policy.pre_hook == ""  # nothing set by hand
        assert redis.cli("SET", "k", "written-before-the-snapshot") == "OK"
        taken = await take_snapshot(c.ctx, TakeSnapshot("data"))
        assert taken.status == "COMPLETE", taken
        assert ran == [addon.BGSAVE_HOOK]
        assert (redis.data / "bgsave.done").exists()  # the running server saved, the hook waited for it
        store = await SnapshotStore.open(c.conn.js)
        assert await store.list(""), "the snapshot is stored"
        rdb = (redis.data / "dump.rdb").read_bytes()
        assert b"written-before-the-snapshot" in rdb

        # a policy's own hook wins over the platform's
        await set_snapshot_policy(c.ctx, SetSnapshotPolicy("data", pre_hook="true"))
        assert (await take_snapshot(c.ctx, TakeSnapshot("data"))).status == "COMPLETE"
        assert ran == [addon.BGSAVE_HOOK, "true"]
        await set_snapshot_policy(c.ctx, SetSnapshotPolicy("data", pre_hook=""))

        # a stopped server: the request is not taken, the hook returns (its files are at rest)
        redis.stop()
        assert (await take_snapshot(c.ctx, TakeSnapshot("data"))).status == "COMPLETE"
        assert ran[-1] == addon.BGSAVE_HOOK and not (redis.data / "bgsave.request").exists()


async def test_no_platform_hook_for_other_volumes(nats_url: str, tmp_path: Path) -> None:
    root = tmp_path / "volumes"
    async with _cluster(nats_url, tmp_path, root) as (c, ran):
        await _placed(c, addon.POSTGRES, "orders", "01PGDATA")
        (root / "01PGDATA").mkdir(parents=True)
        (root / "01PGDATA" / "f").write_text("x")
        assert (await take_snapshot(c.ctx, TakeSnapshot("01PGDATA"))).status == "COMPLETE"
        assert ran == []
    env = pb.Environment()
    env.meta.id = "e"
    env.service.vars[addon.ADDON_VAR] = "redis:7"
    other = pb.Volume(environment_id="e", name="other")
    assert addon.platform_pre_hook(env, other) == ""
    assert addon.platform_pre_hook(None, pb.Volume(environment_id="e", name="data")) == ""
    assert addon.platform_pre_hook(env, pb.Volume(environment_id="e", name="data")) == addon.BGSAVE_HOOK
