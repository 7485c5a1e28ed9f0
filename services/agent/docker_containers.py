"""Containers of the docker runtime: the container configuration an instance runs with (isolation, limits,
network, labels), and :class:`ContainerHandle`, a running container as the agent sees it (its output
copied to the instance's log files with a resumable cursor, exit, stats, exec checks). See
docs/containers.md."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiodocker
from aiodocker.containers import DockerContainer

from services.agent.docker_images import ContainerImage
from services.agent.images import PreparedImage
from services.agent.instance_env import PASSED_THROUGH_ENV, volume_env_name
from services.agent.launchers import LaunchPlan
from services.agent.logs import STREAM_FILES
from shared.files import PRIVATE, write_atomic

log = logging.getLogger(__name__)

LABEL_NODE = "dev.zattera.node"


NOBODY = "65534:65534"


HOST_NETWORK = "host"


BRIDGE_NETWORK = "zattera"
"""The daemon's bridge network instances join when the node runs them bridged (``docker_network``)."""


BIND_ENV = "ZATTERA_BIND_ADDR"


ANY_ADDRESS = "0.0.0.0"


LOOPBACK = "127.0.0.1"


LOG_CURSOR_FILE = "docker-logs.json"


_CURSOR_SAVE_INTERVAL = 0.5


_STATS_TIMEOUT = 5.0


def container_config(
    command: Sequence[str],
    *,
    image: ContainerImage,
    env: Mapping[str, str],
    plan: LaunchPlan,
    labels: Mapping[str, str],
    pids_limit: int,
    network: str = HOST_NETWORK,
    user: str = "",
) -> dict[str, Any]:
    """The Engine API ``ContainerCreate`` body of one instance (see the module docstring), run as ``user``
    (``uid:gid``; "": the image's user, else ``nobody``). On a bridge
    ``network`` the instance listens on every interface of its own network namespace, and each of its ports
    is published at the same number on the node's bind address, where the proxy and health checks reach it
    as on the host network."""
    exposed: dict[str, Any] = {}
    if network != HOST_NETWORK:
        env, exposed = _bridged(env)
    host: dict[str, Any] = {
        "NetworkMode": network,
        # tini as pid 1: signals reach the app (the kernel ignores an unhandled SIGTERM sent to a pid 1) and
        # orphans are reaped.
        "Init": True,
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges"],
        "ReadonlyRootfs": plan.read_only_root,
        "LogConfig": {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "2"}},
        "Binds": [f"{path}:{mount_path}" for path, mount_path in plan.volumes.values()],
    }
    if plan.read_only_root:
        host["Tmpfs"] = {"/tmp": "rw,nosuid,nodev,size=64m"}
    if plan.memory_mb:
        host["Memory"] = host["MemorySwap"] = plan.memory_mb * 1024 * 1024
    if plan.cpu_millis:
        host["NanoCpus"] = plan.cpu_millis * 1_000_000
    if pids_limit:
        host["PidsLimit"] = pids_limit
    if exposed:
        host["PortBindings"] = exposed
    return {
        "Image": image.tag,
        "ExposedPorts": {port: {} for port in exposed},
        "Entrypoint": list(command[:1]),
        "Cmd": list(command[1:]),
        "Env": [f"{k}={v}" for k, v in env.items()],
        "WorkingDir": str(image.workdir),
        "User": user or image.user or NOBODY,
        "Labels": dict(labels),
        "HostConfig": host,
    }


def _bridged(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """(the environment of an instance on a bridge network, its port bindings)."""
    bind = env.get(BIND_ENV, LOOPBACK)
    try:
        published_at = str(ipaddress.ip_address(bind))
    except ValueError:  # a host name: the daemon publishes at addresses only
        published_at = ANY_ADDRESS
    ports = sorted({v for k, v in env.items() if (k == "PORT" or k.startswith("PORT_")) and v.isdigit()})
    bindings = {f"{port}/tcp": [{"HostIp": published_at, "HostPort": port}] for port in ports}
    inside = {**env, BIND_ENV: ANY_ADDRESS}
    if inside.get("HOST") == bind:
        inside["HOST"] = ANY_ADDRESS
    return inside, bindings


def container_env(env: Mapping[str, str], image: PreparedImage, plan: LaunchPlan) -> dict[str, str]:
    """The instance environment for a container: none of the agent's own variables (PATH and the like come
    from the image), and volumes named by where they are mounted."""
    result = {k: v for k, v in env.items() if k not in PASSED_THROUGH_ENV or k in image.env}
    for name, (_, mount_path) in plan.volumes.items():
        result[volume_env_name(name)] = mount_path
    return result


def exit_of(state: Mapping[str, Any]) -> tuple[int | None, bool]:
    """(exit code as the supervisor reads it, OOM-killed) from a container's ``State``: an OOM kill is
    SIGKILL (a negative code, as asyncio reports signals)."""
    oom = bool(state.get("OOMKilled"))
    if oom:
        return -9, True
    code = state.get("ExitCode")
    return (int(code) if code is not None else None), False


def _parse_time(text: str) -> float:
    """Docker's RFC 3339 timestamps (nanoseconds) → epoch seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(head + "+00:00").timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


def since_param(stamp: str) -> str:
    """Docker's ``since`` for an RFC 3339 timestamp of its own, exactly (``<seconds>.<nanoseconds>``): lines
    stamped at that very instant are sent again (the daemon skips only earlier ones)."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    seconds = int(datetime.fromisoformat(head + "+00:00").timestamp())
    return f"{seconds}.{(frac + '0' * 9)[:9]}"


class _LogCursor:
    """Per stream, the timestamp of the last line appended to the instance's output files and how many lines
    of that very timestamp were appended (a flood stamps several lines alike), kept on disk: a follower that
    starts again resumes from that instant and skips exactly those lines (once ``since`` that instant plus a
    microsecond: a line stamped within it was lost)."""

    def __init__(self, instance_dir: Path) -> None:
        self.path = instance_dir / LOG_CURSOR_FILE
        self.since: dict[str, tuple[str, int]] = {}
        try:
            for stream, value in json.loads(self.path.read_text()).items():
                stamp, count = (value, 1) if isinstance(value, str) else (value[0], value[1])
                self.since[str(stream)] = (str(stamp), int(count))
        except (OSError, ValueError, AttributeError, TypeError, IndexError):
            self.since = {}
        self._saved_at = 0.0

    def advance(self, stream: str, timestamp: str) -> None:
        """One more line of ``stream``, stamped ``timestamp``, is in the file."""
        last, count = self.since.get(stream, ("", 0))
        self.since[stream] = (timestamp, count + 1 if timestamp == last else 1)
        self.save()

    def save(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.since and (force or now - self._saved_at >= _CURSOR_SAVE_INTERVAL):
            self._saved_at = now
            cursor = {stream: [stamp, count] for stream, (stamp, count) in self.since.items()}
            write_atomic(self.path, json.dumps(cursor), mode=PRIVATE, durable=False)  # a hint: re-read is safe


class Resume:
    """Which lines a follower starting again at ``since`` (the cursor's timestamp) skips: the first ``skip``
    ones stamped at that instant, already in the file; everything after them is new."""

    def __init__(self, since: str, skip: int) -> None:
        self.since = since
        self.skip = skip if since else 0

    def new(self, stamp: str) -> bool:
        if self.skip and stamp == self.since:
            self.skip -= 1
            return False
        self.skip = 0
        return True


class ContainerHandle:
    """One instance container: its exit, stop, output followers and daemon stats."""

    sandbox_uid = 0
    """Not a process sandbox: the daemon isolates it."""

    def __init__(self, container: DockerContainer, state: Mapping[str, Any], instance_dir: Path) -> None:
        self._container = container
        self.id: str = container.id
        self.pid = int(state.get("Pid") or 0)
        self.create_time = _parse_time(str(state.get("StartedAt") or "1970-01-01T00:00:00Z"))
        self.oom_killed = False
        self._running = bool(state.get("Running"))
        self._cursor = _LogCursor(instance_dir)
        self._files = {name: instance_dir / filename for name, filename in STREAM_FILES.items()}
        self._followers = [
            asyncio.create_task(self._follow(stream), name=f"docker-logs:{self.id[:12]}:{stream}")
            for stream in self._files
        ]
        self._ended: asyncio.Future[int | None] | None = None
        self._usage: tuple[float, int] | None = None
        self._stats = asyncio.create_task(self._follow_stats(), name=f"docker-stats:{self.id[:12]}")

    @property
    def container_id(self) -> str:
        return self.id

    def alive(self) -> bool:
        return self._running

    async def _follow(self, stream: str) -> None:
        since, skip = self._cursor.since.get(stream, ("", 0))
        params: dict[str, Any] = {"timestamps": True}
        if since:
            params["since"] = since_param(since)
        resume = Resume(since, skip)
        try:
            with self._files[stream].open("ab") as sink:
                async for chunk in self._container.log(
                    follow=True, stdout=stream == "stdout", stderr=stream == "stderr", **params
                ):
                    stamp, _, text = chunk.partition(" ")
                    if not text or not resume.new(stamp):  # undecodable (dropped by the client), or copied already
                        continue
                    sink.write(text.encode())
                    sink.flush()
                    self._cursor.advance(stream, stamp)
        except (aiodocker.DockerError, OSError) as exc:
            log.debug("%s: log follower for %s ended: %s", self.id[:12], stream, exc)
        finally:
            self._cursor.save(force=True)

    async def _wait_end(self) -> int | None:
        with contextlib.suppress(aiodocker.DockerError):
            await self._container.wait()
        self._running = False
        self._stats.cancel()
        # The followers end with the container's output; what they append must be in the files before the
        # supervisor ships the last lines.
        await asyncio.wait(self._followers, timeout=5.0)
        try:
            state = (await self._container.show()).get("State", {})
        except aiodocker.DockerError:
            return None
        code, self.oom_killed = exit_of(state)
        with contextlib.suppress(aiodocker.DockerError):
            await self._container.delete(force=True)
        return code

    async def wait(self) -> int | None:
        """The exit code (negative: the killing signal); the container is removed once it has ended."""
        if self._ended is None:
            self._ended = asyncio.ensure_future(self._wait_end())
        return await asyncio.shield(self._ended)

    async def stop(self, grace: float) -> int | None:
        """The image's stop signal (SIGTERM), SIGKILL after ``grace`` seconds (the daemon does both)."""
        with contextlib.suppress(aiodocker.DockerError):
            await self._container.stop(t=max(1, math.ceil(grace)))
        return await self.wait()

    async def detach(self) -> None:
        """Stop following the container (output and stats) without touching it."""
        tasks = [*self._followers, self._stats]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def kill_leftovers(self) -> None:
        """Nothing: a container's processes all end with it (its pid namespace)."""

    async def exec_check(self, command: str) -> bool:
        """An exec health check inside the container (its user, environment and limits): exit status 0."""
        try:
            run = await self._container.exec(["/bin/sh", "-c", command], stdout=True, stderr=True)
            async with run.start(detach=False) as stream:
                while await stream.read_out() is not None:
                    pass
            return (await run.inspect()).get("ExitCode") == 0
        except aiodocker.DockerError:
            return False

    def usage(self) -> tuple[float, int] | None:
        """The daemon's latest figures (streamed about every second); (0, 0) until the first arrives."""
        return self._usage or (0.0, 0)

    async def _follow_stats(self) -> None:
        with contextlib.suppress(aiodocker.DockerError, OSError, ValueError):
            async for doc in self._container.stats(stream=True):
                self._usage = cpu_percent(doc), resident_bytes(doc)

    async def stats(self) -> tuple[float, int]:
        """(CPU percent of one core, resident bytes) from the daemon's one-shot stats (two readings ~1 s
        apart)."""
        raw = await asyncio.wait_for(self._container.stats(stream=False), _STATS_TIMEOUT)
        doc = raw[0] if isinstance(raw, list) else raw
        return cpu_percent(doc), resident_bytes(doc)


def resident_bytes(stats: Mapping[str, Any]) -> int:
    """Memory in use without the page cache (cgroup v1 ``rss``, else usage minus inactive file pages)."""
    memory = stats.get("memory_stats") or {}
    detail = memory.get("stats") or {}
    if "rss" in detail:
        return int(detail["rss"])
    return max(0, int(memory.get("usage") or 0) - int(detail.get("inactive_file") or 0))


def cpu_percent(stats: Mapping[str, Any]) -> float:
    """CPU use between the two samples of one stats document, in percent of one core."""
    now, before = stats.get("cpu_stats") or {}, stats.get("precpu_stats") or {}
    used = (now.get("cpu_usage") or {}).get("total_usage", 0) - (before.get("cpu_usage") or {}).get("total_usage", 0)
    system = now.get("system_cpu_usage", 0) - before.get("system_cpu_usage", 0)
    cpus = now.get("online_cpus") or len((now.get("cpu_usage") or {}).get("percpu_usage") or []) or 1
    if used <= 0 or system <= 0:
        return 0.0
    return float(used) / float(system) * cpus * 100.0
