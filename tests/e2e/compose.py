"""compose.yaml run by ``docker-compose`` on a given daemon: one project with NATS, the agent and the proxy up,
each shape of the control plane brought up beside them in turn (tests/e2e/test_compose_stack.py,
benchmarks/footprint_bench.py).

The images are made once per project (``cli/stack_images.py``, then the Dockerfile's one ``COPY``): on a
``vfs`` daemon every image layer and every container is a full copy of its root filesystem.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiodocker

from cli.stack_images import make_images
from shared.embedded import free_port
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
COMMON = ("nats", "agent", "proxy")  # not prometheus: its image would come from a registry
PER_SERVICE = ("scheduler", "orchestrator", "autoscale", "builds", "routes", "secrets", "certs", "console", "join")
SHAPES = {"all-in-one": ("control-plane",), "per-service": PER_SERVICE}
"""The control-plane services of each shape (compose.yaml's profiles)."""


class ComposeUnavailable(Exception):
    """docker-compose is missing or the daemon makes no bridge network."""


def run(argv: Sequence[str], env: Mapping[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
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


@dataclass
class Stack:
    """One compose project on one daemon: its environment (ports, project name, the CLI's NATS URL)."""

    env: dict[str, str]
    docker_host: str
    took: dict[str, float] = field(default_factory=dict)
    """Seconds each step took (printed: the runtime on vfs)."""

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.took[step] = time.monotonic() - started
            print(f"\n{step}: {self.took[step]:.0f}s", end="", file=sys.stderr, flush=True)

    def compose(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-f", str(ROOT / "compose.yaml"), *args], self.env, timeout)

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", *services).stdout[-8000:]

    async def containers(self, service: str) -> list[dict[str, Any]]:
        """``docker inspect`` of the service's running containers."""
        docker = aiodocker.Docker(url=self.docker_host)
        try:
            labels = [f"com.docker.compose.project={self.env['COMPOSE_PROJECT_NAME']}"]
            listed = await docker.containers.list(filters={"label": [*labels, f"com.docker.compose.service={service}"]})
            return [await c.show() for c in listed]
        finally:
            await docker.close()

    async def memory(self, container_id: str) -> float:
        """The container's memory as its limit counts it (cgroup usage less inactive page cache), MB."""
        docker = aiodocker.Docker(url=self.docker_host)
        try:
            stats = await (await docker.containers.get(container_id)).stats(stream=False)
            memory = stats[0]["memory_stats"]
            cache = memory["stats"].get("total_inactive_file", memory["stats"].get("inactive_file", 0))
            return float(memory["usage"] - cache) / 2**20
        finally:
            await docker.close()

    async def kill(self, container_id: str) -> None:
        docker = aiodocker.Docker(url=self.docker_host)
        try:
            await (await docker.containers.get(container_id)).kill()
        finally:
            await docker.close()

    async def all_healthy(self, services: Sequence[str]) -> bool:
        for service in services:
            found = await self.containers(service)
            if not found or any(c["State"].get("Health", {}).get("Status") != "healthy" for c in found):
                return False
        return True

    @contextlib.asynccontextmanager
    async def shape(self, name: str, healthy_within: float = 600) -> AsyncIterator[tuple[str, ...]]:
        """The shape's control plane up, every container of the project healthy, until the block ends (then
        stopped: SIGTERM releases its leases at once for the next shape); yields its services."""
        services = SHAPES[name]
        with self.timed(f"{name}: containers created and started"):
            up = await asyncio.to_thread(self.compose, "up", "-d", "--no-build", *services)
        assert up.returncode == 0, up.stderr[-3000:]
        try:
            with self.timed(f"{name}: every container healthy"):
                await eventually(lambda: self.all_healthy((*COMMON, *services)), healthy_within, f"{name} healthy")
            yield services
        finally:
            await asyncio.to_thread(self.compose, "stop", "-t", "20", *services)


@contextlib.contextmanager
def composed(docker_host: str, **settings: str) -> Iterator[Stack]:
    """A new project on ``docker_host`` with the images made, NATS, the agent and the proxy up (``settings``:
    more environment for docker-compose and the containers); killed and removed with its volumes after."""
    if shutil.which("docker-compose") is None:
        raise ComposeUnavailable("docker-compose is not installed (make system-packages installs it)")
    reason = asyncio.run(bridge_refused(docker_host))
    if reason:
        raise ComposeUnavailable(f"the daemon makes no bridge network: {reason}")
    ports = {
        name: str(free_port())
        for name in ("ZATTERA_NATS_PORT", "ZATTERA_NATS_MONITOR_PORT", "ZATTERA_PROXY_PORT", "ZATTERA_CONSOLE_PORT")
    }
    env = {
        **{k: v for k, v in os.environ.items() if k != "ZATTERA_DATA_DIR"},
        **ports,
        "DOCKER_HOST": docker_host,
        "COMPOSE_PROJECT_NAME": f"zt{uuid.uuid4().hex[:8]}",
        "COMPOSE_HTTP_TIMEOUT": "900",  # creating a container copies its whole root filesystem on vfs
        "ZATTERA_NATS_URL": f"nats://127.0.0.1:{ports['ZATTERA_NATS_PORT']}",  # the CLI's, on the host
        **settings,
    }
    stack = Stack(env, docker_host)
    with stack.timed("images made"):
        asyncio.run(make_images(docker_host, os.path.realpath(sys.executable)))
    try:
        with stack.timed("image built"):
            built = stack.compose("build", "agent")  # one image for every Zattera container
        assert built.returncode == 0, built.stderr[-3000:]
        with stack.timed("nats, agent, proxy up"):
            up = stack.compose("up", "-d", "--no-build", *COMMON)
        assert up.returncode == 0, up.stderr[-3000:]
        yield stack
    finally:
        stack.compose("kill")  # nothing to drain: removing is what costs (a vfs copy per container)
        stack.compose("down", "--volumes")
