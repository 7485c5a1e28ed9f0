"""The docker runtime against the process runtime, on a private dockerd (``tests/dockerd.py``: vfs storage,
no bridge) with the busybox base image; the app is busybox ``httpd`` in both runtimes.

Run: ``python -m benchmarks.containers_bench [--full] [--json]`` (also part of ``make bench``).

1. **Start → listening.** The agent's launcher starts the app (process: ``spawn``; docker: create + start
   of a container with every limit and the host network, as its environment's user from the uid table as
   the agent runs it) and the time until its port accepts a connection is measured; the two runtimes
   alternate in the same run, and so does a container run as the image's user (``nobody``: no uid table,
   what the docker runtime did before its containers were fenced), for the cost of that user. CPU per
   start: the launcher's own (this process, during ``spawn``) and the daemon's (dockerd, containerd, the
   shims and the ``runc`` they reaped, whose command lines name the private daemon's directory).
   10 samples each quick, 40 full.
2. **A Python app (stdlib ``http.server``) start → listening**: a bare process of the node's interpreter
   against a container on the Python base image the docker runtime makes from that interpreter
   (``services/agent/pythonbase.py``: what a source-built Python app runs on). Also measured once: making
   that base image (root filesystem tar + import into the daemon) and the bytes of its files (each container
   copies them on vfs storage), and the bytes of the Node base's files (``services/agent/hostbase.py``).
   3 samples each quick, 20 full.
3. **Scale-to-zero cold start on docker.** The whole product (e2e harness, agents with ``--runtime
   docker``), an env with ``scale_to_zero`` (idle 2 s) cooled to zero; one request through the proxy.
   Measured: request sent → the first route snapshot with a healthy endpoint, and → the answer. The
   control-plane overhead is that first figure minus the container's own start → listening (1., p50):
   activation → scale write → placement → agent (image ready, container create/start) → first health probe →
   observed write → route build → snapshot. 3 samples quick, 10 full. Target p50 ≤ 300 ms.

Anchor: the process runtime in the same run (1.) and benchmarks/e2e_bench.py's cold start (process runtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import psutil

from benchmarks.common import Row, bench_main, listening, median, percentile, row
from services.agent.docker_images import ContainerImage
from services.agent.docker_runtime import DockerLauncher
from services.agent.hostbase import inspect_node, node_rootfs_tar, tar_size
from services.agent.images import PreparedImage
from services.agent.launchers import InstanceHandle, Launcher, LaunchPlan, ProcessLauncher
from services.agent.pythonbase import PYTHON_LABEL, inspect_interpreter, python_rootfs_tar
from services.agent.sandbox_users import UidTable
from shared.embedded import free_port
from tests.dockerd import BASE_IMAGE, BUSYBOX, private_dockerd
from tests.e2e.cluster import E2ECluster, env_by_name, healthy, running
from tests.waiting import eventually

COLD_TOML = """
project = "demo"
app = "web"

[env.cold]
replicas = { min = 1, max = 1 }
scale_to_zero = true
idle_timeout = "2s"
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }
"""
SERVE = (
    "mkdir -p /tmp/www && echo ok > /tmp/www/healthz && echo hi > /tmp/www/index.html && "
    "exec httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h /tmp/www"
)
NODE_PYTHON = os.path.realpath(sys.executable)
"""The interpreter the builder installs Python apps for (and the agent runs on)."""


def _busybox_httpd(launcher: Launcher, port: int, workdir: Path) -> list[str]:
    if isinstance(launcher, DockerLauncher):
        return ["httpd", "-f", "-p", f"127.0.0.1:{port}", "-h", "/tmp"]
    return [str(BUSYBOX), "httpd", "-f", "-p", f"127.0.0.1:{port}", "-h", str(workdir)]


def _python_http_server(launcher: Launcher, port: int, workdir: Path) -> list[str]:
    return [NODE_PYTHON, "-I", "-m", "http.server", "--bind", "127.0.0.1", str(port)]


def _daemon_cpu(marker: str) -> float:
    """CPU seconds of the processes whose command line names ``marker`` (the private daemon's directory), the
    children they reaped included."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if any(marker in part for part in proc.info["cmdline"] or ()):
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
    return total


async def _start_once(
    launcher: Launcher,
    image: PreparedImage,
    workdir: Path,
    app: Callable[[Launcher, int, Path], list[str]],
    cpu: dict[str, list[float]] | None = None,
) -> float:
    port = free_port()
    command = app(launcher, port, workdir)
    instance = workdir / f"instance-{port}"
    instance.mkdir(exist_ok=True)  # a port may come round again
    marker = str(workdir.parent / "dockerd")
    daemon_before = _daemon_cpu(marker) if cpu is not None else 0.0
    own_before = time.process_time()
    started = time.monotonic()
    handle: InstanceHandle = await launcher.spawn(
        command,
        image=image,
        env={"PORT": str(port)},
        instance_dir=instance,
        plan=LaunchPlan(memory_mb=64, cpu_millis=500, tenant="bench"),  # one environment: its user made once
        labels={"dev.zattera.assignment": f"bench-{port}"},
    )
    own = time.process_time() - own_before
    await listening(port)
    elapsed = time.monotonic() - started
    if cpu is not None:
        cpu["launcher"].append(own)
        cpu["daemon"].append(_daemon_cpu(marker) - daemon_before)
    await handle.stop(1.0)
    return elapsed


async def _start_to_listening(
    docker_host: str, samples: int, workdir: Path
) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """(start → listening seconds per launcher, CPU seconds per start of the two docker ones)."""
    uids = UidTable(workdir / "uids", base=0x70000000, count=65536)
    docker = DockerLauncher(docker_host, node_id="bench", base_image=BASE_IMAGE, pids_limit=256, uids=uids)
    image_user = DockerLauncher(docker_host, node_id="bench", base_image=BASE_IMAGE, pids_limit=256)
    process = ProcessLauncher()
    try:
        docker_image = ContainerImage("bench", Path("/"), tag=BASE_IMAGE)
        process_image = PreparedImage("bench", workdir)
        out: dict[str, list[float]] = {"docker": [], "process": [], "image-user": []}
        cpu: dict[str, dict[str, list[float]]] = {
            name: {"launcher": [], "daemon": []} for name in ("docker", "image-user")
        }
        for index in range(samples):
            out["process"].append(await _start_once(process, process_image, workdir, _busybox_httpd))
            pair = [("docker", docker), ("image-user", image_user)]
            for name, launcher in pair if index % 2 else reversed(pair):  # alternate which goes first
                out[name].append(await _start_once(launcher, docker_image, workdir, _busybox_httpd, cpu[name]))
        return out, cpu
    finally:
        await docker.close()
        await image_user.close()


async def _python_starts(docker_host: str, samples: int, workdir: Path) -> dict[str, list[float]]:
    """The Python base image made once (timed), then a stdlib HTTP server started on both runtimes."""
    docker = DockerLauncher(docker_host, node_id="bench", base_image=BASE_IMAGE, pids_limit=256)
    process = ProcessLauncher()
    try:
        made = time.monotonic()
        tag = await docker.program_base({PYTHON_LABEL: NODE_PYTHON})
        out: dict[str, list[float]] = {"base": [time.monotonic() - made], "docker": [], "process": []}
        docker_image = ContainerImage("bench-python", Path("/tmp"), tag=tag)
        process_image = PreparedImage("bench-python", workdir)
        for _ in range(samples):
            out["process"].append(await _start_once(process, process_image, workdir, _python_http_server))
            out["docker"].append(await _start_once(docker, docker_image, workdir, _python_http_server))
        return out
    finally:
        await docker.close()


async def _cold_starts(docker_host: str, root: Path, samples: int) -> dict[str, list[float]]:
    from shared.routeclient import RouteClient

    cluster = E2ECluster(
        root / "cluster",
        trace=False,
        timers={"ZATTERA_AGENT_RUNTIME": "docker", "ZATTERA_AGENT_DOCKER_HOST": docker_host},
    )
    out: dict[str, list[float]] = {"endpoint": [], "response": []}
    try:
        await asyncio.to_thread(cluster.start)
        await cluster.wait_ready()
        toml = root / "zattera.toml"
        toml.write_text(COLD_TOML)
        await cluster.acli("apps", "apply", str(toml))
        await cluster.acli("deploy", "--image", "exec:" + quote(SERVE, safe=""), "--env", "demo/web/cold")
        async with cluster.state() as (conn, view):
            env = env_by_name(view, "cold")
            assert env is not None
            env_id = env.meta.id
            routes = RouteClient(root / "routes.pb")
            await routes.start(conn)
            seen_at: dict[int, float] = {}

            async def follow() -> None:
                updates = routes.updates()
                try:
                    async for snapshot in updates:
                        if any(
                            r.environment_id == env_id and any(e.healthy for e in r.endpoints)
                            for r in snapshot.http_routes
                        ):
                            seen_at.setdefault(snapshot.version, time.monotonic())
                finally:
                    updates.close()

            follower = asyncio.create_task(follow())
            try:
                for _ in range(samples):
                    await eventually(
                        lambda: (
                            (e := view.env(env_id)) is not None
                            and e.effective_replicas == 0
                            and not running(view, env_id)
                        ),
                        120,
                        "cooled to zero",
                    )
                    await eventually(
                        lambda: (
                            not any(r.environment_id == env_id and r.endpoints for r in routes.current.http_routes)
                            and cluster.proxy_routes_version() >= routes.version
                        ),
                        60,
                        "no endpoint left in the snapshot, the proxy's included",
                    )
                    seen_at.clear()
                    sent = time.monotonic()
                    status, body = await cluster.get("web-cold.localhost", timeout=60)
                    answered = time.monotonic()
                    assert status == 200, body
                    await eventually(lambda: bool(seen_at), 10, "endpoint snapshot seen")
                    await eventually(lambda: bool(healthy(view, env_id)), 10, "the woken replica in the view")
                    out["endpoint"].append(min(seen_at.values()) - sent)
                    out["response"].append(answered - sent)
            finally:
                follower.cancel()
                await routes.stop()
    finally:
        await asyncio.to_thread(cluster.stop)
    return out


def run(quick: bool = True) -> list[Row]:
    starts, python_starts, colds = (10, 3, 3) if quick else (40, 20, 10)
    root = Path(tempfile.mkdtemp(prefix="zattera-containers-bench-"))
    try:
        with private_dockerd(root / "dockerd") as docker_host:
            workdir = root / "work"
            workdir.mkdir()
            started, start_cpu = asyncio.run(_start_to_listening(docker_host, starts, workdir))
            python = asyncio.run(_python_starts(docker_host, python_starts, workdir))
            cold = asyncio.run(_cold_starts(docker_host, root, colds))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = 1000.0
    container_start = median(started["docker"])
    overhead = [endpoint - container_start for endpoint in cold["endpoint"]]
    same_run = "process runtime, same run"
    return [
        row("process: start → listening p50", median(started["process"]) * ms, "ms", "", "anchor for the docker rows"),
        row("process: start → listening p99", percentile(started["process"], 99) * ms, "ms", "", ""),
        row("docker: start → listening p50 (create + start + listen)", container_start * ms, "ms", "", same_run),
        row("docker: start → listening p99", percentile(started["docker"], 99) * ms, "ms", "", same_run),
        row(
            "docker as the image's user (unfenced): start → listening p50",
            median(started["image-user"]) * ms,
            "ms",
            "",
            "the row above, alternating",
        ),
        *_cpu_rows(start_cpu),
        row("python app: process start → listening p50", median(python["process"]) * ms, "ms", "", "anchor"),
        row("python app: docker start → listening p50", median(python["docker"]) * ms, "ms", "", same_run),
        row("python app: docker start → listening p99", percentile(python["docker"], 99) * ms, "ms", "", same_run),
        row("python base image: made and imported (once per daemon)", python["base"][0] * ms, "ms", "", ""),
        row("python base image: bytes of its files", _python_base_megabytes(), "MB", "", ""),
        row("node base image: bytes of its files", _node_base_megabytes(), "MB", "", ""),
        row(
            "docker cold start: control-plane overhead p50 (held → endpoint − container start)",
            median(overhead) * ms,
            "ms",
            "≤ 300 ms",
            "e2e_bench cold start (process runtime)",
        ),
        row("docker cold start: held → endpoint in snapshot p50", median(cold["endpoint"]) * ms, "ms", "", ""),
        row("docker cold start: held request answered p50", median(cold["response"]) * ms, "ms", "", ""),
    ]


def _cpu_rows(cpu: dict[str, dict[str, list[float]]]) -> list[Row]:
    """CPU per docker start p50, the launcher's and the daemon's, as the environment's and the image's user."""
    label = {"docker": "docker", "image-user": "docker as the image's user"}
    return [
        row(f"{label[name]}: {side} CPU per start p50", median(cpu[name][side]) * 1000.0, "ms", "", "")
        for side in ("launcher", "daemon")
        for name in ("docker", "image-user")
    ]


def _python_base_megabytes() -> float:
    return tar_size(python_rootfs_tar(inspect_interpreter(NODE_PYTHON))) / 1e6


def _node_base_megabytes() -> float:
    """What a source-built Node app runs on (``services/agent/hostbase.py``)."""
    return tar_size(node_rootfs_tar(inspect_node(os.path.realpath(shutil.which("node") or "node")))) / 1e6


def main() -> None:
    bench_main("Containers", run, __doc__, "40 start samples per runtime and 10 cold starts")


if __name__ == "__main__":
    main()
