"""Managed databases under the docker runtime (docs/addons.md): the add-on's release (its ``exec:`` image,
its entry command, its volumes, its variables and secrets) started by the docker launcher on a real
(private) Docker daemon, on the add-ons' base image the launcher makes from this node's PostgreSQL,
pgBackRest and Redis (``services/agent/addonbase.py``); then a real query from the node, over TCP."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from functools import partial
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from services.agent.docker_containers import ContainerHandle
from services.agent.docker_images import ContainerImage
from services.agent.docker_runtime import DockerLauncher
from services.agent.launchers import TENANT_KEY, LaunchPlan
from services.agent.sandbox_users import UidTable
from shared.addons import spec as addon
from shared.embedded import free_port
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, release
from tests.agent.test_runtime import seed, set_desired, state_of
from tests.waiting import eventually

PG_BIN = addon.postgres_bin("15")
HEALTHY = pb.INSTANCE_STATE_HEALTHY
STOPPED = pb.INSTANCE_STATE_STOPPED


def _volumes(root: Path, spec_volumes: list[tuple[str, str]]) -> dict[str, tuple[Path, str]]:
    return {name: (root / name, mount) for name, mount in spec_volumes}


async def _start(
    launcher: DockerLauncher, engine: str, root: Path, env: dict[str, str]
) -> tuple[str, dict[str, tuple[Path, str]], ContainerHandle]:
    spec = addon.service_spec(engine, addon.ENGINES[engine][0], "orders")
    image = await launcher.prepare(None, addon.IMAGE_REF, root / "instance", platform="linux/amd64")  # type: ignore[arg-type]
    assert isinstance(image, ContainerImage) and image.tag.startswith("zattera/addons:")
    volumes = _volumes(root, [(v.volume_name, v.mount_path) for v in spec.volumes])
    handle = await launcher.spawn(
        image.command(spec.command),  # as the agent composes it (instances.py)
        image=image,
        env={**dict(spec.vars), **env, "HOST": "127.0.0.1"},
        instance_dir=root / "instance",
        plan=LaunchPlan(volumes=volumes, tenant="E1"),
        labels={"dev.zattera.assignment": f"A-{engine}"},
    )
    assert isinstance(handle, ContainerHandle)
    return spec.healthcheck.command, volumes, handle


async def test_a_postgres_and_a_redis_addon_run_as_containers_and_answer(docker_host: str, tmp_path: Path) -> None:
    assert shutil.which("pgbackrest") and shutil.which(f"{PG_BIN}/postgres") and shutil.which("redis-server")
    # the agent's uid table: the container runs as the env's own uid, which no /etc/passwd of the node names
    uids = UidTable(tmp_path / "sandbox", base=0x70000000, count=65536)
    launcher = DockerLauncher(docker_host, node_id="d1", base_image="zattera/base:latest", pids_limit=512, uids=uids)
    try:
        pg_port, redis_port = free_port(), free_port()
        secret, app_secret, redis_secret = addon.new_password(), addon.new_password(), addon.new_password()
        pg_env = {"PORT_POSTGRES": str(pg_port), "POSTGRES_PASSWORD": secret, "APP_PASSWORD": app_secret}
        pg_check, pg_volumes, pg = await _start(launcher, addon.POSTGRES, tmp_path / addon.POSTGRES, pg_env)
        redis_env = {"PORT_REDIS": str(redis_port), "REDIS_PASSWORD": redis_secret}
        redis_check, redis_volumes, redis = await _start(launcher, addon.REDIS, tmp_path / addon.REDIS, redis_env)
        data = pg_volumes[addon.DATA_VOLUME][0]
        await eventually(lambda: (data / "ready").exists(), what="postgres ready (base backup taken)", timeout=180)

        def query() -> str:
            url = f"postgresql://{addon.APP_USER}@127.0.0.1:{pg_port}/{addon.APP_DB}"
            done = subprocess.run(
                [f"{PG_BIN}/psql", "-X", "-Atc", "select current_user || ' ' || 40 + 2", url],
                env={**os.environ, "PGPASSWORD": app_secret},
                capture_output=True,
                text=True,
                timeout=30,
            )
            return done.stdout.strip()

        assert await asyncio.to_thread(query) == "app 42"
        assert await pg.exec_check(pg_check)  # the add-on's own health check, inside its container
        # written by the env's user, as the process runtime's sandbox would
        assert (data / "pgdata" / "PG_VERSION").stat().st_uid == uids.uid(TENANT_KEY + "E1")
        assert any((pg_volumes[addon.BACKUPS_VOLUME][0] / "repo" / "backup" / "orders").iterdir())

        def ping() -> str:
            done = subprocess.run(
                ["redis-cli", "--no-auth-warning", "-h", "127.0.0.1", "-p", str(redis_port), "ping"],
                env={**os.environ, "REDISCLI_AUTH": redis_secret},
                capture_output=True,
                text=True,
                timeout=10,
            )
            return done.stdout.strip()

        await eventually(lambda: (redis_volumes[addon.DATA_VOLUME][0] / "run" / "redis.sock").exists(), what="redis")
        assert await asyncio.to_thread(ping) == "PONG"
        await eventually(partial(redis.exec_check, redis_check), what="redis health check")
        for handle in (pg, redis):
            assert await handle.stop(30) == 0
        for engine in (addon.POSTGRES, addon.REDIS):
            for log in (tmp_path / engine / "instance").glob("*.log"):
                text = log.read_text()
                assert all(s not in text for s in (secret, app_secret, redis_secret)), log
    finally:
        await launcher.close()


async def test_the_agent_runs_a_postgres_addons_release_in_a_container_until_healthy(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    """The node's agent on the docker runtime (its uid table, its port allocation, its exec health check
    inside the container) with an add-on's release; the passwords as plain variables here (the sealed
    secrets' path is the runtime's, not this test's)."""
    await start_agent("d1", runtime="docker", docker_host=docker_host)
    rel = release(addon.IMAGE_REF, healthcheck=False)
    rel.service.CopyFrom(addon.service_spec(addon.POSTGRES, "15", "orders"))
    rel.service.healthcheck.interval.FromMilliseconds(500)
    app_secret = addon.new_password()
    rel.service.vars.update({"POSTGRES_PASSWORD": addon.new_password(), "APP_PASSWORD": app_secret})
    a = assignment("d1", rel)
    volumes = []
    for name in (addon.DATA_VOLUME, addon.BACKUPS_VOLUME):
        volume = pb.Volume(project_id="P1", environment_id="E1", name=name, node_id="d1")
        volume.meta.id = f"V{name.upper()}"
        volume.status = pb.VOLUME_STATUS_ACTIVE
        volume.lease.node_id, volume.lease.assignment_id = "d1", a.meta.id
        volume.lease.expires_at.GetCurrentTime()
        volume.lease.expires_at.seconds += 600
        volumes.append(volume)
    await seed(writer, rel, a, *volumes)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="the add-on HEALTHY", timeout=240)
    observed = view.observed("d1", a.meta.id)
    assert observed is not None and observed.container_id
    port = observed.mesh_port_bindings[addon.POSTGRES]
    host = "127.0.0.1"  # the test node's mesh address

    def query() -> str:
        done = subprocess.run(
            [f"{PG_BIN}/psql", "-X", "-Atc", "select 6 * 7", f"postgresql://app@{host}:{port}/app"],
            env={**os.environ, "PGPASSWORD": app_secret},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip() + done.stderr.strip()

    assert await asyncio.to_thread(query) == "42"
    await set_desired(writer, view, a, pb.ASSIGNMENT_DESIRED_STOP)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == STOPPED, what="stopped", timeout=90)
