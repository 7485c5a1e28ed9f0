"""The docker runtime: each instance is a container of a local Docker daemon, driven through the Engine API
(``aiodocker``). See docs/containers.md.

* **Images.** A registry image (``<project>/<app>:<tag>``) is fetched from the cluster registry and loaded
  into the daemon as a derived image: ``FROM`` the node's base image (``docker_base_image``; ``scratch``
  for an image that carries its own root filesystem, label ``dev.zattera.rootfs=full``, as
  ``zattera images import`` writes), then its layers ``ADD``ed in order. It is tagged
  ``zattera-local/<digest>`` and reused while the daemon keeps it. ``docker://<name>`` is an image of the
  daemon (pulled by it when missing: from a registry the daemon can reach). ``exec:<command>`` runs the
  command in the base image (tests, demos), except a managed database's (``addon.IMAGE_REF``): the add-ons'
  base image (``addonbase.py``); ``process://`` refs need the process runtime.
* **Isolation.** Host network (the allocated ``PORT`` env as for processes), its own pid namespace, its
  environment's own user (``uids``: the uid table of the process runtime's sandbox, ``sandbox_users.py``;
  the image's ``User`` is not used), ``no-new-privileges``, every capability dropped, a read-only root
  filesystem (with a ``/tmp`` tmpfs) when the release sets ``read_only_root``; volumes bind-mounted at their
  ``mount_path``, given to that user. Nothing of the agent's data directory is visible inside. Running as
  a uid of the table puts the container's sockets behind the agent's network fence (``firewall.py``): it
  cannot connect to NATS or any other listener of the control plane, on an open cluster too.
* **Limits.** ``memory_mb`` (no swap beyond it; an OOM kill is reported as such), ``cpu_millis``
  (``NanoCpus``) and the node's ``pids_limit``.
* **Output.** The daemon keeps the container's output (json-file); a follower per stream appends it to the
  instance's ``stdout.log``/``stderr.log``, which ``logs.py`` ships as for processes. The follower resumes
  from the last copied timestamp after an agent restart, skipping exactly the lines of that instant it had
  copied (``docker-logs.json``).
* **Lifecycle.** Containers carry the labels ``dev.zattera.node`` and ``dev.zattera.assignment``; a restarted
  agent adopts a running one its record names (no restart); :func:`DockerLauncher.sweep` removes containers
  of this node nobody references and derived images no container uses.

The pieces: ``docker_images.py`` (derived images), ``docker_containers.py`` (container configuration and
handles), ``runtime_choice.py`` (the runtime choice, which loads this module only when a daemon may answer),
this module (the launcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import json
import logging
import os
import subprocess
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from urllib.parse import unquote

import aiodocker

from services.agent.addonbase import WORKDIR as ADDON_WORKDIR
from services.agent.addonbase import addon_rootfs_tar, inspect_addon_programs
from services.agent.docker_containers import (
    BRIDGE_NETWORK,
    HOST_NETWORK,
    LABEL_NODE,
    LOOPBACK,
    NOBODY,
    ContainerHandle,
    container_config,
    container_env,
)
from services.agent.docker_images import (
    DOCKER_SCHEME,
    LABEL_MANAGED,
    LABEL_ROOTFS,
    ContainerImage,
    build_context,
    container_image,
    derived_tag,
    docker_archive,
    first_line,
    managed,
)
from services.agent.hostbase import (
    PASSWD,
    SHELL,
    BaseImageError,
    inspect_node,
    node_of,
    node_rootfs_tar,
    shell_rootfs_tar,
)
from services.agent.images import EXEC_SCHEME, PROCESS_SCHEME, ImageError, PreparedImage, shell_command
from services.agent.launchers import (
    DOCKER,
    LABEL_ASSIGNMENT,
    ImageRequest,
    InstanceHandle,
    Launch,
    Launcher,
    ProcessLauncher,
    retain_tenant_uids,
)
from services.agent.processes import InstanceRecord
from services.agent.pythonbase import inspect_interpreter, python_of, python_rootfs_tar
from services.agent.runtime_choice import PROCESS_FALLBACK, DockerUnavailable, RuntimeChoice, docker_url
from services.agent.sandbox_users import UidTable, give
from services.agent.settings import AgentSettings
from shared.addons import spec as addon
from shared.registry import RegistryError, digest_of, fetch_image
from shared.registryauth import auth_for

log = logging.getLogger(__name__)


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


class DockerLauncher(Launcher):
    """Instances as containers of one Docker daemon (see the module docstring)."""

    name = DOCKER

    def __init__(
        self,
        host: str,
        *,
        node_id: str,
        base_image: str,
        pids_limit: int,
        network: str = HOST_NETWORK,
        uids: UidTable | None = None,
    ) -> None:
        self.docker = aiodocker.Docker(url=docker_url(host))
        self.uids = uids
        """The environments' users; None: the image's user, else ``nobody`` (not fenced: tests, benchmarks)."""
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
            return first_line(exc.message)
        self.network = BRIDGE_NETWORK
        return ""

    async def bridge_interface(self) -> str:
        """The host's interface of the bridge network instances join ("" on the host network): what the
        network fence also watches (``firewall.py``)."""
        if self.network == HOST_NETWORK:
            return ""
        try:
            info = await (await self.docker.networks.get(self.network)).show()
        except aiodocker.DockerError:
            return ""
        named = (info.get("Options") or {}).get("com.docker.network.bridge.name")
        return str(named or f"br-{str(info.get('Id') or '')[:12]}")

    async def has_image(self, name: str) -> bool:
        try:
            await self.docker.images.inspect(name)
            return True
        except aiodocker.DockerError:
            return False

    async def _prepare(self, request: ImageRequest) -> PreparedImage:
        ref = request.ref
        if not ref:
            raise ImageError("the release has no image yet")
        if ref.startswith(PROCESS_SCHEME):
            raise ImageError(f"{ref}: process:// images need the process runtime")
        if ref.startswith(DOCKER_SCHEME):
            return await self._daemon_image(ref, request.registry_auth)
        if ref == addon.IMAGE_REF:
            return ContainerImage(
                ref,
                Path(ADDON_WORKDIR),
                cmd=shell_command(unquote(ref[len(EXEC_SCHEME) :])),
                tag=await self.addon_base(),
                named_user=True,
            )
        if ref.startswith(EXEC_SCHEME):
            return ContainerImage(
                ref, Path("/"), cmd=shell_command(unquote(ref[len(EXEC_SCHEME) :])), tag=self.base_image
            )
        try:
            fetched = await fetch_image(request.conn, ref, platform=request.platform)
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
                raise ImageError(f"{ref}: pull: {first_line(exc.message)}") from exc
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
        return await self._base(tag, program, rootfs)

    async def addon_base(self) -> str:
        """The base image managed databases run on (``addonbase.py``), made from this node's PostgreSQL,
        pgBackRest and Redis the first time an add-on needs it."""
        try:
            found = await asyncio.to_thread(inspect_addon_programs)
        except BaseImageError as exc:
            raise ImageError(str(exc)) from exc
        return await self._base(found.tag, "the add-ons' programs", partial(addon_rootfs_tar, found))

    async def _base(self, tag: str, program: str, rootfs: Callable[[], bytes]) -> str:
        """``tag``, made once (concurrent starts share one build) when the daemon lacks it."""
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
            raise ImageError(f"loading into docker: {first_line(exc.message)}") from exc

    async def _spawn(self, launch: Launch) -> InstanceHandle:
        image, plan, instance_dir = launch.image, launch.plan, launch.instance_dir
        assert isinstance(image, ContainerImage)
        user = image.user or NOBODY
        if self.uids is not None:
            uid = self.uids.uid(launch.tenant_key)
            user = f"{uid}:{uid}"
        volumes = [path for path, _ in plan.volumes.values()]
        if volumes:
            await asyncio.to_thread(_give_volumes, volumes, user)
        config = container_config(
            launch.command,
            image=image,
            env=container_env(launch.env, image, plan),
            plan=plan,
            labels={**launch.labels, LABEL_MANAGED: "true", LABEL_NODE: self.node_id},
            pids_limit=self.pids_limit,
            network=self.network,
            user=user,
        )
        if image.named_user:
            passwd = await asyncio.to_thread(_write_passwd, instance_dir, user)
            config["HostConfig"]["Binds"] = [*config["HostConfig"].get("Binds", []), f"{passwd}:/etc/passwd:ro"]
        try:
            container = await self.docker.containers.create(config)
        except aiodocker.DockerError as exc:
            raise OSError(f"docker: {first_line(exc.message)}") from exc
        try:
            await container.start()
            state = (await container.show()).get("State", {})
        except aiodocker.DockerError as exc:
            with contextlib.suppress(aiodocker.DockerError):
                await container.delete(force=True)  # created, never ran: nobody would remove it
            raise OSError(f"docker: {first_line(exc.message)}") from exc
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
        if self.uids is not None:
            retain_tenant_uids(self.uids, tenants)

    async def prune_images(self) -> None:
        """Derived images no container uses (the daemon refuses to remove one in use anyway)."""
        used = {c["ImageID"] for c in await self.docker.containers.list(all=True) if "ImageID" in c._container}
        for image in await self.docker.images.list(filters={"label": [f"{LABEL_MANAGED}=true"]}):
            if image["Id"] not in used:
                with contextlib.suppress(aiodocker.DockerError):
                    await self.docker.images.delete(image["Id"], force=False)


def _write_passwd(instance_dir: Path, user: str) -> Path:
    """An ``/etc/passwd`` naming the container's user (``initdb`` refuses a user without a name), beside
    ``root`` and ``nobody``: mounted over the image's (``named_user``)."""
    uid, _, gid = user.partition(":")
    if not uid.isdigit():
        uid = "65534"
    lines = [line for line in PASSWD.decode().splitlines() if line.split(":")[2] != uid]
    lines.append(f"zattera:x:{uid}:{gid if gid.isdigit() else uid}::{ADDON_WORKDIR}:/bin/sh")
    path = instance_dir / "passwd"
    instance_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)
    return path


def _give_volumes(paths: Sequence[Path], user: str) -> None:
    """Volume directories belong to the container's user (numeric ``uid[:gid]``), when the agent may chown:
    the whole tree, as the sandbox gives them (files an earlier user of the volume wrote stay writable)."""
    uid_text, _, gid_text = user.partition(":")
    if not uid_text.isdigit() or os.geteuid() != 0:
        return
    uid = int(uid_text)
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        if gid_text.isdigit() and int(gid_text) != uid:
            os.chown(path, uid, int(gid_text))
        else:
            give(path, uid)


async def docker_choice(settings: AgentSettings) -> RuntimeChoice:
    """The docker runtime, once a daemon answers (``runtime_choice.choose_launcher``): the base image made when
    the daemon lacks it, the network ``settings`` ask for; processes with a warning when the base image cannot
    be made, unless docker was asked for (:class:`DockerUnavailable`)."""
    process = ProcessLauncher(adopted_poll_interval=settings.adopted_poll_interval)
    url = docker_url(settings.docker_host)
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
            f"({exc}): {PROCESS_FALLBACK}"
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
