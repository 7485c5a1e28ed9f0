"""The docker runtime: each instance is a container of a local Docker daemon, driven through the Engine API
(``aiodocker``). See docs/containers.md.

* **Images.** A registry image (``<project>/<app>:<tag>``) is fetched from the cluster registry and loaded
  into the daemon as a derived image: ``FROM`` the node's base image (``docker_base_image``; ``scratch``
  for an image that carries its own root filesystem, label ``dev.zattera.rootfs=full``, as
  ``zattera images import`` writes), then its layers ``ADD``ed in order. It is tagged
  ``zattera-local/<digest>`` and reused while the daemon keeps it. ``docker://<name>`` is an image of the
  daemon (pulled by it when missing: from a registry the daemon can reach). ``exec:<command>`` runs the
  command in the base image (tests, demos); ``process://`` refs need the process runtime.
* **Isolation.** Host network (the allocated ``PORT`` env as for processes), its own pid namespace, the
  image's user or else ``nobody`` (65534), ``no-new-privileges``, every capability dropped, a read-only
  root filesystem (with a ``/tmp`` tmpfs) when the release sets ``read_only_root``; volumes bind-mounted
  at their ``mount_path``. Nothing of the agent's data directory is visible inside.
* **Limits.** ``memory_mb`` (no swap beyond it; an OOM kill is reported as such), ``cpu_millis``
  (``NanoCpus``) and the node's ``pids_limit``.
* **Output.** The daemon keeps the container's output (json-file); a follower per stream appends it to the
  instance's ``stdout.log``/``stderr.log``, which ``logs.py`` ships as for processes. The follower resumes
  from the last copied timestamp after an agent restart, skipping exactly the lines of that instant it had
  copied (``docker-logs.json``).
* **Lifecycle.** Containers carry the labels ``dev.zattera.node`` and ``dev.zattera.assignment``; a restarted
  agent adopts a running one its record names (no restart); :func:`DockerLauncher.sweep` removes containers
  of this node nobody references and derived images no container uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import json
import logging
import math
import os
import subprocess
import tarfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiodocker
from aiodocker.containers import DockerContainer

from services.agent.hostbase import SHELL, BaseImageError, inspect_node, node_of, node_rootfs_tar, shell_rootfs_tar
from services.agent.images import EXEC_SCHEME, PROCESS_SCHEME, ImageError, PreparedImage, shell_command
from services.agent.instance_env import PASSED_THROUGH_ENV, volume_env_name
from services.agent.launchers import DOCKER, PROCESS, InstanceHandle, Launcher, LaunchPlan, ProcessLauncher
from services.agent.logs import STREAM_FILES
from services.agent.processes import InstanceRecord
from services.agent.pythonbase import inspect_interpreter, python_of, python_rootfs_tar
from services.agent.settings import AgentSettings
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.files import PRIVATE, write_atomic
from shared.registry import RegistryError, digest_of, fetch_image
from shared.registryauth import auth_for

log = logging.getLogger(__name__)

LABEL_MANAGED = "dev.zattera.managed"
LABEL_NODE = "dev.zattera.node"
LABEL_ASSIGNMENT = "dev.zattera.assignment"
LABEL_ROOTFS = "dev.zattera.rootfs"
"""On a registry image config: ``full`` = its layers are a whole root filesystem (no base image under it)."""
LOCAL_REPO = "zattera-local"
DOCKER_SCHEME = "docker://"
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


class DockerUnavailable(ZatteraError):
    """No Docker daemon answers at the configured address."""


def docker_url(host: str) -> str:
    """The daemon address aiodocker takes: ``unix:///path`` or ``tcp://…`` (default: ``$DOCKER_HOST`` or the
    standard socket)."""
    return host or os.environ.get("DOCKER_HOST", "") or "unix:///var/run/docker.sock"


async def daemon_answers(host: str, timeout: float = 2.0) -> bool:
    """Whether a Docker daemon answers at ``host`` within ``timeout`` seconds."""
    try:
        docker = aiodocker.Docker(url=docker_url(host))
    except (ValueError, OSError):
        return False
    try:
        await asyncio.wait_for(docker.version(), timeout)
        return True
    except (TimeoutError, aiodocker.DockerError, OSError, ValueError):
        return False
    finally:
        await docker.close()


@dataclass(frozen=True)
class ContainerImage(PreparedImage):
    """A prepared image loaded into the daemon: ``workdir`` is a path inside the container."""

    tag: str = ""
    user: str = ""


def container_image(ref: str, tag: str, run: Mapping[str, Any]) -> ContainerImage:
    """What an image config's ``config`` section says about running it."""
    return ContainerImage(
        ref,
        Path(str(run.get("WorkingDir") or "/")),
        entrypoint=[str(x) for x in run.get("Entrypoint") or []],
        cmd=[str(x) for x in run.get("Cmd") or []],
        env=dict(item.split("=", 1) for item in run.get("Env") or [] if "=" in item),
        tag=tag,
        user=str(run.get("User") or ""),
    )


def _first_line(message: object) -> str:
    return str(message).strip().splitlines()[0] if str(message).strip() else "failed"


def derived_tag(digest: str) -> str:
    return f"{LOCAL_REPO}:{digest.removeprefix('sha256:')[:32]}"


def build_context(base: str, layers: Sequence[bytes], labels: Mapping[str, str]) -> bytes:
    """A gzip'd build context: a Dockerfile ``FROM base`` that ``ADD``s each layer (Docker unpacks a local tar
    it ``ADD``s), and the layers themselves."""
    lines = [f"FROM {base}"]
    lines += [f"LABEL {json.dumps(k)}={json.dumps(v)}" for k, v in labels.items()]
    files = {"Dockerfile": b""}
    for index, layer in enumerate(layers):
        name = f"layer{index}.tar.gz"
        files[name] = layer
        lines.append(f"ADD {name} /")
    files["Dockerfile"] = ("\n".join(lines) + "\n").encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def managed(config: bytes) -> bytes:
    """The image config labelled as ours, so :meth:`DockerLauncher.prune_images` may remove it."""
    doc = json.loads(config)
    run = doc.get("config") or {}
    run["Labels"] = {**(run.get("Labels") or {}), LABEL_MANAGED: "true"}
    doc["config"] = run
    return json.dumps(doc).encode()


def docker_archive(tag: str, config: bytes, layers: Sequence[bytes]) -> bytes:
    """A ``docker load`` tarball of one image (its layers may stay gzip'd: the daemon decompresses)."""
    files = {"config.json": config}
    for index, layer in enumerate(layers):
        files[f"{index}/layer.tar"] = layer
    manifest = [{"Config": "config.json", "RepoTags": [tag], "Layers": [f"{i}/layer.tar" for i in range(len(layers))]}]
    files["manifest.json"] = json.dumps(manifest).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def container_config(
    command: Sequence[str],
    *,
    image: ContainerImage,
    env: Mapping[str, str],
    plan: LaunchPlan,
    labels: Mapping[str, str],
    pids_limit: int,
    network: str = HOST_NETWORK,
) -> dict[str, Any]:
    """The Engine API ``ContainerCreate`` body of one instance (see the module docstring). On a bridge
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
        "User": image.user or NOBODY,
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


class DockerLauncher:
    """Instances as containers of one Docker daemon (see the module docstring)."""

    name = DOCKER

    def __init__(
        self, host: str, *, node_id: str, base_image: str, pids_limit: int, network: str = HOST_NETWORK
    ) -> None:
        self.docker = aiodocker.Docker(url=docker_url(host))
        self.node_id = node_id
        self.network = network
        self.base_image = base_image
        self.pids_limit = pids_limit
        self._loading: dict[str, asyncio.Future[None]] = {}
        """Images being put into the daemon, by tag."""
        self._handles: weakref.WeakSet[ContainerHandle] = weakref.WeakSet()

    async def close(self) -> None:
        """The agent stops: its followers stop copying (the next run resumes them); containers keep running."""
        await asyncio.gather(*(handle.detach() for handle in list(self._handles)), return_exceptions=True)
        await self.docker.close()

    def _track(self, handle: ContainerHandle) -> ContainerHandle:
        self._handles.add(handle)
        return handle

    async def use_bridge(self) -> str:
        """Join instances to the bridge network ``zattera`` (made when missing): "" when done, else why the
        daemon cannot (a daemon without bridge support, e.g. no bridge module in the kernel)."""
        try:
            try:
                await self.docker.networks.get(BRIDGE_NETWORK)
            except aiodocker.DockerError:
                await self.docker.networks.create(
                    {"Name": BRIDGE_NETWORK, "Driver": "bridge", "Labels": {LABEL_MANAGED: "true"}}
                )
        except aiodocker.DockerError as exc:
            return _first_line(exc.message)
        self.network = BRIDGE_NETWORK
        return ""

    async def has_image(self, name: str) -> bool:
        try:
            await self.docker.images.inspect(name)
            return True
        except aiodocker.DockerError:
            return False

    async def prepare(
        self,
        conn: Connection,
        ref: str,
        instance_dir: Path,
        *,
        platform: str,
        registry_auth: Mapping[str, str] | None = None,
    ) -> PreparedImage:
        if not ref:
            raise ImageError("the release has no image yet")
        if ref.startswith(PROCESS_SCHEME):
            raise ImageError(f"{ref}: process:// images need the process runtime")
        if ref.startswith(DOCKER_SCHEME):
            return await self._daemon_image(ref, registry_auth)
        if ref.startswith(EXEC_SCHEME):
            return ContainerImage(
                ref, Path("/"), cmd=shell_command(unquote(ref[len(EXEC_SCHEME) :])), tag=self.base_image
            )
        try:
            fetched = await fetch_image(conn, ref, platform=platform)
        except (RegistryError, KeyError, ValueError) as exc:
            raise ImageError(f"{ref}: {exc}") from exc
        try:
            run = (json.loads(fetched.config or b"{}").get("config")) or {}
        except (ValueError, AttributeError) as exc:
            raise ImageError(f"{ref}: bad image config: {exc}") from exc
        tag = derived_tag(digest_of(fetched.config + b"".join(digest_of(layer).encode() for layer in fetched.layers)))
        labels = run.get("Labels") or {}
        full = labels.get(LABEL_ROOTFS) == "full"
        base = "scratch" if full else await self.program_base(labels)
        await self._load(tag, fetched.config if full else None, fetched.layers, base=base)
        return container_image(ref, tag, run)

    async def _daemon_image(self, ref: str, registry_auth: Mapping[str, str] | None) -> ContainerImage:
        """A ``docker://`` ref: the daemon's image by that name, pulled when it does not have it (with the
        environment's registry credentials when they are for that image's registry: ``X-Registry-Auth``)."""
        name = ref[len(DOCKER_SCHEME) :]
        try:
            info = await self.docker.images.inspect(name)
        except aiodocker.DockerError:
            try:
                await self.docker.images.pull(name, auth=auth_for(name, registry_auth))
                info = await self.docker.images.inspect(name)
            except aiodocker.DockerError as exc:
                raise ImageError(f"{ref}: pull: {_first_line(exc.message)}") from exc
        return container_image(ref, name, info.get("Config") or {})

    async def ensure_base_image(self) -> bool:
        """Make the node's generic base image (``base_image``) from this node's shell and busybox when the
        daemon does not hold it (``hostbase.shell_rootfs_tar``); True when it was made now."""
        if await self.has_image(self.base_image):
            return False
        await self._make_program_base(self.base_image, SHELL, shell_rootfs_tar)
        return True

    async def program_base(self, labels: Mapping[str, str]) -> str:
        """The base image a built image runs on: one holding the program its labels name (the interpreter a
        Python app's packages were installed for, the ``node`` of a Node app), made from this node's copy of
        it the first time an image needs it (``hostbase.py``, ``pythonbase.py``); else the node's base
        image."""
        try:
            if python_of(labels):
                interpreter = await asyncio.to_thread(inspect_interpreter, python_of(labels))
                tag, program, rootfs = interpreter.tag, interpreter.path, partial(python_rootfs_tar, interpreter)
            elif node_of(labels):
                node = await asyncio.to_thread(inspect_node, node_of(labels))
                tag, program, rootfs = node.tag, node.path, partial(node_rootfs_tar, node)
            else:
                return self.base_image
        except BaseImageError as exc:
            raise ImageError(str(exc)) from exc
        if await self.has_image(tag):
            return tag
        loading = self._loading.get(tag)
        if loading is None:
            loading = asyncio.ensure_future(self._make_program_base(tag, program, rootfs))
            self._loading[tag] = loading
            loading.add_done_callback(lambda _: self._loading.pop(tag, None))
        await asyncio.shield(loading)
        return tag

    async def _make_program_base(self, tag: str, program: str, rootfs: Callable[[], bytes]) -> None:
        log.info("making the base image %s from %s", tag, program)
        try:
            data = await asyncio.to_thread(rootfs)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ImageError(f"base image from {program}: {exc}") from exc
        await self._put(tag, None, [data], "scratch")

    async def _load(self, tag: str, full_config: bytes | None, layers: Sequence[bytes], *, base: str) -> None:
        """Put the image into the daemon once (concurrent starts of the same image share one load, which a
        cancelled start does not interrupt): an image with its own root filesystem (``full_config``) as it is
        (``docker load``), any other built ``FROM`` ``base``."""
        if await self.has_image(tag):
            return
        loading = self._loading.get(tag)
        if loading is None:
            loading = asyncio.ensure_future(self._put(tag, full_config, layers, base))
            self._loading[tag] = loading
            loading.add_done_callback(lambda _: self._loading.pop(tag, None))
        await asyncio.shield(loading)

    async def _put(self, tag: str, full_config: bytes | None, layers: Sequence[bytes], base: str) -> None:
        try:
            if full_config is not None:
                await self.docker.images.import_image(docker_archive(tag, managed(full_config), layers))
            else:
                # A base image is not ours to prune: every later Python or Node image of the node runs on it.
                labels = {LABEL_MANAGED: "true"} if base != "scratch" else {}
                context = build_context(base, layers, labels)
                await self.docker.images.build(
                    fileobj=io.BytesIO(context), encoding="gzip", tag=tag, rm=True, forcerm=True
                )
        except aiodocker.DockerError as exc:
            raise ImageError(f"loading into docker: {_first_line(exc.message)}") from exc

    async def spawn(
        self,
        command: Sequence[str],
        *,
        image: PreparedImage,
        env: Mapping[str, str],
        instance_dir: Path,
        plan: LaunchPlan,
        labels: Mapping[str, str],
    ) -> InstanceHandle:
        assert isinstance(image, ContainerImage)
        user = image.user or NOBODY
        for path, _ in plan.volumes.values():
            _give_to(path, user)
        config = container_config(
            command,
            image=image,
            env=container_env(env, image, plan),
            plan=plan,
            labels={**labels, LABEL_MANAGED: "true", LABEL_NODE: self.node_id},
            pids_limit=self.pids_limit,
            network=self.network,
        )
        try:
            container = await self.docker.containers.create(config)
        except aiodocker.DockerError as exc:
            raise OSError(f"docker: {_first_line(exc.message)}") from exc
        try:
            await container.start()
            state = (await container.show()).get("State", {})
        except aiodocker.DockerError as exc:
            with contextlib.suppress(aiodocker.DockerError):
                await container.delete(force=True)  # created, never ran: nobody would remove it
            raise OSError(f"docker: {_first_line(exc.message)}") from exc
        return self._track(ContainerHandle(container, state, instance_dir))

    async def adopt(self, record: InstanceRecord, instance_dir: Path) -> InstanceHandle | None:
        """The recorded container if it still runs and is this node's instance of that assignment."""
        if not record.container_id:
            return None
        try:
            container = self.docker.containers.container(record.container_id)
            info = await container.show()
        except aiodocker.DockerError:
            return None
        labels = (info.get("Config") or {}).get("Labels") or {}
        state = info.get("State") or {}
        if labels.get(LABEL_NODE) != self.node_id or labels.get(LABEL_ASSIGNMENT) != record.assignment_id:
            return None
        if not state.get("Running"):
            with contextlib.suppress(aiodocker.DockerError):
                await container.delete(force=True)
            return None
        return self._track(ContainerHandle(container, state, instance_dir))

    async def sweep(self, keep: set[str]) -> None:
        """Remove this node's containers not in ``keep`` (ids) and the derived images no container uses."""
        containers = await self.docker.containers.list(
            all=True, filters=json.dumps({"label": [f"{LABEL_NODE}={self.node_id}"]})
        )
        for container in containers:
            if container.id not in keep:
                log.info("removing container %s nobody references", container.id[:12])
                with contextlib.suppress(aiodocker.DockerError):
                    await container.delete(force=True)
        await self.prune_images()

    def retain_tenants(self, tenants: set[str]) -> None:
        return None  # containers run as the image's user or nobody: no user per tenant to forget

    async def prune_images(self) -> None:
        """Derived images no container uses (the daemon refuses to remove one in use anyway)."""
        used = {c["ImageID"] for c in await self.docker.containers.list(all=True) if "ImageID" in c._container}
        for image in await self.docker.images.list(filters={"label": [f"{LABEL_MANAGED}=true"]}):
            if image["Id"] not in used:
                with contextlib.suppress(aiodocker.DockerError):
                    await self.docker.images.delete(image["Id"], force=False)


def _give_to(path: Path, user: str) -> None:
    """A volume directory belongs to the container's user (numeric ``uid[:gid]``), when the agent may chown."""
    uid_text, _, gid_text = user.partition(":")
    if not uid_text.isdigit() or os.geteuid() != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, int(uid_text), int(gid_text) if gid_text.isdigit() else int(uid_text))


@dataclass(frozen=True)
class RuntimeChoice:
    """The node's runtime and why (``zattera up`` prints it; the node record carries it)."""

    launcher: Launcher
    reason: str


async def choose_launcher(settings: AgentSettings) -> RuntimeChoice:
    """The node's runtime: as ``settings.runtime`` says; unset, docker when a daemon answers (the agent makes
    the base image when the daemon lacks it), else processes with a warning (bare processes are neither
    isolated nor limited)."""
    process = ProcessLauncher(adopted_poll_interval=settings.adopted_poll_interval)
    if settings.runtime == PROCESS:
        return RuntimeChoice(process, "chosen by --runtime process (ZATTERA_AGENT_RUNTIME)")
    url = docker_url(settings.docker_host)
    answers = await daemon_answers(settings.docker_host)
    if not answers and settings.runtime == DOCKER:
        raise DockerUnavailable(f"runtime docker: no Docker daemon answers at {url}")
    if not answers:
        why = f"no Docker daemon answers at {url}: apps run as bare processes, without isolation or limits"
        log.warning("%s (install Docker, or --runtime to choose)", why)
        return RuntimeChoice(process, why)
    docker = DockerLauncher(
        settings.docker_host,
        node_id=settings.node_id,
        base_image=settings.docker_base_image,
        pids_limit=settings.pids_limit,
    )
    try:
        made = await docker.ensure_base_image()
    except ImageError as exc:
        await docker.close()
        if settings.runtime == DOCKER:
            raise DockerUnavailable(f"runtime docker: the base image {settings.docker_base_image}: {exc}") from exc
        why = (
            f"the Docker daemon at {url} answers, but making its base image {settings.docker_base_image} failed "
            f"({exc}): apps run as bare processes, without isolation or limits"
        )
        log.warning("%s (--runtime to choose)", why)
        return RuntimeChoice(process, why)
    base = f"base image {settings.docker_base_image} " + ("made by this agent" if made else "present")
    how = "chosen by --runtime docker" if settings.runtime == DOCKER else "a Docker daemon answers"
    return RuntimeChoice(await _networked(docker, settings), f"{how} at {url} ({base})")


async def _networked(docker: DockerLauncher, settings: AgentSettings) -> DockerLauncher:
    """``docker`` on the network ``settings.docker_network`` asks for: ``bridge`` stops the agent with one line
    when the daemon makes no bridge network; ``auto`` bridges only when it can and the instances' address is
    not a loopback one (published there, a bridged instance could not reach the node's loopback services),
    else stays on the host network."""
    mode = settings.docker_network
    if mode == "auto" and _on_loopback(settings.mesh_ip):
        return docker
    if mode in ("bridge", "auto"):
        refused = await docker.use_bridge()
        if refused and mode == "bridge":
            await docker.close()
            raise DockerUnavailable(f"docker_network bridge: the daemon makes no bridge network: {refused}")
        if refused:
            log.warning("the Docker daemon makes no bridge network (%s): instances use the host network", refused)
    return docker


def _on_loopback(mesh_ip: str) -> bool:
    try:
        return ipaddress.ip_address(mesh_ip or LOOPBACK).is_loopback
    except ValueError:  # a host name
        return mesh_ip == "localhost"
