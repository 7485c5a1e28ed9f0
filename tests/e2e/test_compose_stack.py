"""compose.yaml and the Dockerfile for real: ``docker-compose`` (Debian's 1.29) brings the control-plane stack
up on the session's private dockerd (NATS, the all-in-one control plane, an agent, the proxy, on the
project's bridge network with published ports), from images made on this machine (``cli/stack_images.py``:
no registry); the real CLI on the host deploys examples/hello through it from source, and the app answers
200 through the composed proxy; then everything is torn down.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiodocker
import pytest

from cli.stack_images import make_images
from shared.embedded import free_port
from tests.e2e.cluster import cli_argv
from tests.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("nats", "control-plane", "agent", "proxy")  # not prometheus: its image would come from a registry


def run(argv: list[str], env: Mapping[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


async def bridge_refused(docker_host: str) -> str:
    """ "" when the daemon can make a bridge network, else why not."""
    docker = aiodocker.Docker(url=docker_host)
    try:
        network = await docker.networks.create({"Name": f"zt-probe-{uuid.uuid4().hex[:8]}", "Driver": "bridge"})
        await network.delete()
        return ""
    except aiodocker.DockerError as exc:
        return str(exc.message)
    finally:
        await docker.close()


@pytest.fixture
def stack(docker_host: str) -> Iterator[dict[str, str]]:
    """The composed stack, up; yields the environment the CLI and docker-compose use."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (make system-packages installs it)")
    ports = {
        name: str(free_port())
        for name in ("ZATTERA_NATS_PORT", "ZATTERA_NATS_MONITOR_PORT", "ZATTERA_PROXY_PORT", "ZATTERA_CONSOLE_PORT")
    }
    env = {**os.environ, **ports, "DOCKER_HOST": docker_host, "COMPOSE_PROJECT_NAME": f"zt{uuid.uuid4().hex[:8]}"}
    env.pop("ZATTERA_DATA_DIR", None)
    reason = asyncio.run(bridge_refused(docker_host))
    if reason:
        pytest.skip(f"the daemon makes no bridge network: {reason}")
    asyncio.run(make_images(docker_host, os.path.realpath(sys.executable)))
    compose = ["docker-compose", "-f", str(ROOT / "compose.yaml")]
    try:
        up = run([*compose, "up", "-d", "--build", *SERVICES], env)
        assert up.returncode == 0, up.stderr[-3000:]
        yield {**env, "ZATTERA_NATS_URL": f"nats://127.0.0.1:{ports['ZATTERA_NATS_PORT']}"}
    finally:
        run([*compose, "kill"], env)  # nothing to drain: removing is what costs (a vfs copy per container)
        run([*compose, "down", "--volumes"], env)


def logs(env: Mapping[str, str]) -> str:
    return run(["docker-compose", "-f", str(ROOT / "compose.yaml"), "logs", "--no-color", "--tail", "30"], env).stdout


def zattera(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run([*cli_argv(), *args], env, timeout=120)


def test_the_composed_stack_deploys_the_example_app_and_serves_it(stack: dict[str, str]) -> None:
    try:
        deploy_and_get_hello(stack)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs(stack)[-6000:]}") from None


def deploy_and_get_hello(stack: dict[str, str]) -> None:
    def node_registered() -> bool:
        listed = zattera(stack, "nodes", "list", "--json")
        return listed.returncode == 0 and any(n["meta"]["id"] == "compose-node" for n in json.loads(listed.stdout))

    eventually_sync(node_registered, 90, "the composed agent registers")
    applied = zattera(stack, "apps", "apply", "examples/hello/zattera.toml")
    assert applied.returncode == 0, applied.stderr
    deployed = zattera(stack, "deploy", "examples/hello", "--env", "demo/hello/production")
    assert deployed.returncode == 0 and "live: release" in deployed.stderr, deployed.stdout + deployed.stderr

    proxy = http.client.HTTPConnection("127.0.0.1", int(stack["ZATTERA_PROXY_PORT"]), timeout=10)
    try:
        proxy.request("GET", "/", headers={"Host": "hello.localhost"})
        response = proxy.getresponse()
        assert response.status == 200
        body = json.loads(response.read())
    finally:
        proxy.close()
    assert body["hello"] == "world" and body["node"] == "compose-node"
