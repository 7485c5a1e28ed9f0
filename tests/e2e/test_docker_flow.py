"""The docker runtime end to end: the whole control plane, two agents running containers on the session's
private dockerd, the proxy, the real CLI. A red/green redeploy under load fails no request; examples/flask,
built from source by the stack builder with real PyPI packages, answers through the proxy from a container
on the Python base image its node made from its own interpreter.

The red/green app is busybox ``httpd`` on the base image (``exec:`` image refs: no build), answering ``/``
with its version as the example app does, and ``/healthz``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import aiodocker
import pytest
from zattera.v1 import types_pb2 as pb

from shared.registryauth import REGISTRY_AUTH_SECRET
from tests.agent.test_registry_auth import PASSWORD, USER, push_private_image, registry
from tests.e2e.cluster import E2ECluster, Load, cli_argv, healthy
from tests.e2e.test_stack_deploys import deploy, served, source
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
__all__ = ["registry"]  # the fixture the private-registry test uses

PROD = "demo/web/production"
HOST = "web.localhost"
TOML = """
project = "demo"
app = "web"

[env.production]
replicas = { min = 2, max = 2 }
resources = { cpu_millis = 100, memory_mb = 32 }
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }
domains = ["web.localhost"]
"""


def httpd_image(version: str) -> str:
    serve = (
        f'mkdir -p /tmp/www && echo \'{{"version": "{version}"}}\' > /tmp/www/index.html && '
        "echo ok > /tmp/www/healthz && exec httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h /tmp/www"
    )
    return "exec:" + quote(serve, safe="")


@pytest.fixture(scope="module")
def docker_cluster(tmp_path_factory: pytest.TempPathFactory, docker_host: str) -> Iterator[E2ECluster]:
    root: Path = tmp_path_factory.mktemp("e2e-docker")
    c = E2ECluster(
        root,
        trace=False,
        timers={"ZATTERA_AGENT_RUNTIME": "docker", "ZATTERA_AGENT_DOCKER_HOST": docker_host},
    )
    try:
        c.start()
        try:
            asyncio.run(c.wait_ready())
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the e2e cluster did not come up: {exc!r}\n{c.log_tail()}") from None
        yield c
    finally:
        c.stop()


async def test_red_green_on_the_docker_runtime_fails_no_request(docker_cluster: E2ECluster, tmp_path: Path) -> None:
    cluster = docker_cluster
    toml = tmp_path / "zattera.toml"
    toml.write_text(TOML)
    await cluster.acli("apps", "apply", str(toml))
    nodes = await cluster.acli("nodes", "list", "--json")
    assert nodes.stdout.count('"docker"') == 2, nodes.stdout

    await cluster.acli("deploy", "--image", httpd_image("v1"), "--env", PROD)

    async def served(version: str) -> bool:
        status, body = await cluster.get(HOST)
        return status == 200 and version in body

    await eventually(lambda: served("v1"), 30, "v1 answers through the proxy")
    load = Load(cluster.proxy_port, HOST, rate=40).start()
    try:
        await eventually(lambda: load.ok >= 20, 30, "load is flowing")
        await cluster.acli("deploy", "--image", httpd_image("v2"), "--env", PROD)
        await eventually(lambda: load.versions["v2"] >= 20, 60, "v2 serves")
        async with cluster.state() as (_, view):
            env = next(e for e in view.envs() if e.name == "production")
            await eventually(
                lambda: {a.release_id for a in view.assignments(env.meta.id)} == {env.active_release_id},
                60,
                "blue replicas removed",
            )
            live = healthy(view, env.meta.id, env.active_release_id)
            assert len(live) == 2 and all(a.observed.container_id for a in live)
            assert all(a.observed.state == pb.INSTANCE_STATE_HEALTHY for a in live)
        seen = load.versions["v2"]
        await eventually(lambda: load.versions["v2"] >= seen + 20, 30, "v2 keeps serving after blue is gone")
    finally:
        await load.stop()
    assert load.versions["v1"] > 0 and load.versions["v2"] > 0, load.summary()
    assert load.failures == [], load.summary()


async def test_flask_built_from_source_answers_through_the_proxy_from_a_container(
    docker_cluster: E2ECluster, tmp_path: Path
) -> None:
    output = await deploy(docker_cluster, source(tmp_path, "flask", {}, example="flask"))
    assert "live: release" in output, output
    await served(docker_cluster, "flask.localhost", "hello from flask")
    async with docker_cluster.state() as (_, view):
        env = next(e for e in view.envs() if (app := view.app(e.app_id)) is not None and app.name == "flask")
        live = healthy(view, env.meta.id, env.active_release_id)
        assert live and all(a.observed.container_id for a in live)


SERVE_PRIVATE = (
    "mkdir -p /tmp/www && echo private-ok > /tmp/www/index.html && echo ok > /tmp/www/healthz && "
    "exec httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h /tmp/www"
)
PRIVATE_TOML = """
project = "demo"
app = "private"

[run]
command = 'SERVE'

[env.production]
replicas = { min = 1, max = 1 }
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }
domains = ["private.localhost"]
""".replace("SERVE", SERVE_PRIVATE)


async def test_a_private_registry_image_deploys_with_the_envs_registry_credentials(
    docker_cluster: E2ECluster, docker_host: str, registry: str, tmp_path: Path
) -> None:
    """``zattera registry login`` seals the credentials; the agent opens them at start and pulls with them
    (``X-Registry-Auth``) from a registry that refuses anonymous pulls; they are in no container's
    environment and in no file the cluster wrote (its NATS store, logs, traces, agents' data)."""
    cluster = docker_cluster
    name = await push_private_image(docker_host, registry)
    toml = tmp_path / "zattera.toml"
    toml.write_text(PRIVATE_TOML)
    await cluster.acli("apps", "apply", str(toml))
    env = "demo/private/production"
    login = await asyncio.to_thread(
        subprocess.run,
        [*cli_argv(), "registry", "login", registry, "--env", env, "--username", USER],
        input=PASSWORD,
        env={**os.environ, **cluster.env(), "ZATTERA_NATS_URL": cluster.url, "ZATTERA_DATA_DIR": str(cluster.root)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert login.returncode == 0 and PASSWORD not in login.stdout + login.stderr, login.stderr
    deployed = await cluster.acli("deploy", "--image", f"docker://{name}", "--env", env)
    assert PASSWORD not in deployed.stdout + deployed.stderr

    await served(cluster, "private.localhost", "private-ok")
    async with cluster.state() as (_, view):
        e = next(e for e in view.envs() if (app := view.app(e.app_id)) is not None and app.name == "private")
        live = healthy(view, e.meta.id, e.active_release_id)
    docker = aiodocker.Docker(url=docker_host)
    try:
        for a in live:
            shown = await (await docker.containers.get(a.observed.container_id)).show()
            assert not any(REGISTRY_AUTH_SECRET in v or PASSWORD in v for v in shown["Config"]["Env"])
    finally:
        await docker.close()
    leaks = [p for p in cluster.root.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    assert not leaks, leaks


async def test_the_hello_example_packed_as_is_runs_in_a_container_on_the_nodes_interpreter(
    docker_cluster: E2ECluster, tmp_path: Path
) -> None:
    """examples/hello has no dependencies (provider none) and starts with ``python3 app.py``: its image runs on
    the Python base image, not on the busybox-like base (which has no python3), so containers by default
    keep the README's example working."""
    src = source(tmp_path, "hello", {}, example="hello")
    (src / "zattera.toml").write_text((src / "zattera.toml").read_text() + '\n[run]\ncommand = "python3 app.py"\n')
    output = await deploy(docker_cluster, src)
    assert "plan: provider none" in output and "the start command runs Python" in output, output
    assert "live: release" in output, output
    await served(docker_cluster, "hello.localhost", '"hello": "world"')
