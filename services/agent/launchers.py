"""How an instance is launched on this node: the runtime interface the supervisors use (``runtime.py``).

Two runtimes implement it: ``process`` (a process of the host, in a bubblewrap sandbox as its environment's
user when the node can (``sandbox.py``), else of the agent's user; ``processes.py``/``images.py``) and
``docker`` (a container through the Docker Engine API, ``docker_runtime.py``). A node runs one of them,
chosen by ``--runtime`` (docs/containers.md).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.agent.images import PreparedImage, prepare_image
from services.agent.processes import Confined, InstanceRecord, adopt, spawn
from services.agent.sandbox import Confinement, Sandbox
from services.agent.sandbox_users import UidTable, give
from shared.connection import Connection

PROCESS = "process"
DOCKER = "docker"
RUNTIMES = (PROCESS, DOCKER)


@dataclass(frozen=True)
class LaunchPlan:
    """What the release asks of the instance beyond its command and environment (the docker runtime enforces
    it; the process runtime only reserves it at placement)."""

    memory_mb: int = 0
    cpu_millis: int = 0
    read_only_root: bool = False
    volumes: Mapping[str, tuple[Path, str]] = field(default_factory=dict)
    """Volume name → (its directory on this node, where the release mounts it)."""
    tenant: str = ""
    """Whose instance this is (the environment id): instances of one tenant share a user on the node."""


class InstanceHandle(Protocol):
    """A running instance, spawned in this agent run or adopted from a previous one."""

    @property
    def pid(self) -> int: ...
    @property
    def create_time(self) -> float: ...
    @property
    def container_id(self) -> str: ...
    @property
    def oom_killed(self) -> bool: ...
    @property
    def sandbox_uid(self) -> int:
        """The uid of a sandboxed process (0: none), recorded for a restarted agent to adopt it as such."""
        ...

    @property
    def exec_check(self) -> Callable[[str], Awaitable[bool]] | None:
        """Runs an exec health check where the instance runs (None: on the host, in its directory)."""
        ...

    def alive(self) -> bool: ...
    def usage(self) -> tuple[float, int] | None:
        """(CPU percent of one core, resident bytes) as the runtime measures it; None: sample the pid."""
        ...

    async def wait(self) -> int | None: ...
    async def stop(self, grace: float) -> int | None: ...
    def kill_leftovers(self) -> None: ...


TENANT_KEY = "env:"
"""Prefix of an environment's key in the sandbox's uid table (builds use ``build:``)."""
LABEL_ASSIGNMENT = "dev.zattera.assignment"
"""The label of an instance naming its assignment."""


@dataclass(frozen=True)
class ImageRequest:
    """What :meth:`Launcher.prepare` is asked for: the image ``ref`` of an instance in ``instance_dir``."""

    conn: Connection
    ref: str
    instance_dir: Path
    platform: str
    registry_auth: Mapping[str, str] | None = None
    """The environment's registry credentials (shared/registryauth.py), for a pull by a Docker daemon."""


@dataclass(frozen=True)
class Launch:
    """What :meth:`Launcher.spawn` starts: ``command`` in a prepared ``image``, with ``env``, as ``plan`` asks."""

    command: Sequence[str]
    image: PreparedImage
    env: Mapping[str, str]
    instance_dir: Path
    plan: LaunchPlan
    labels: Mapping[str, str]

    @property
    def tenant_key(self) -> str:
        """The instance's key in the uid table: its tenant's (its assignment's when the plan names no tenant)."""
        return TENANT_KEY + (self.plan.tenant or self.labels.get(LABEL_ASSIGNMENT, ""))


class Launcher(ABC):
    """A runtime of this node. The supervisors call :meth:`prepare` and :meth:`spawn`; a runtime implements
    them as :meth:`_prepare` and :meth:`_spawn`, which take the call's arguments as one object."""

    name: str

    async def prepare(
        self,
        conn: Connection,
        ref: str,
        instance_dir: Path,
        *,
        platform: str,
        registry_auth: Mapping[str, str] | None = None,
    ) -> PreparedImage:
        """The image ``ref`` ready to run; ``registry_auth``: the environment's registry credentials
        (shared/registryauth.py), for a pull by a Docker daemon."""
        return await self._prepare(ImageRequest(conn, ref, instance_dir, platform, registry_auth))

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
        return await self._spawn(Launch(command, image, env, instance_dir, plan, labels))

    @abstractmethod
    async def _prepare(self, request: ImageRequest) -> PreparedImage: ...

    @abstractmethod
    async def _spawn(self, launch: Launch) -> InstanceHandle: ...

    @abstractmethod
    async def adopt(self, record: InstanceRecord, instance_dir: Path) -> InstanceHandle | None: ...

    @abstractmethod
    async def sweep(self, keep: set[str]) -> None:
        """After adoption: remove what this node's runtime left that no instance in ``keep`` (container ids)
        uses."""

    @abstractmethod
    async def prune_images(self) -> None:
        """Remove the runtime's images no instance uses any more."""

    @abstractmethod
    def retain_tenants(self, tenants: set[str]) -> None:
        """Forget the users of tenants with nothing left on this node."""

    @abstractmethod
    async def close(self) -> None: ...


def retain_tenant_uids(uids: UidTable, tenants: set[str]) -> None:
    """Forget the users of tenants not in ``tenants``."""
    uids.retain({TENANT_KEY + t for t in tenants}, prefix=TENANT_KEY)


class ProcessLauncher(Launcher):
    """Processes of the host: sandboxed as their environment's user when ``sandbox`` is given (``sandbox.py``),
    else bare processes of the agent's user (no isolation). No limits either way (``images.py``)."""

    name = PROCESS

    def __init__(self, *, adopted_poll_interval: float = 1.0, sandbox: Sandbox | None = None) -> None:
        self._poll_interval = adopted_poll_interval
        self.sandbox = sandbox

    async def _prepare(self, request: ImageRequest) -> PreparedImage:
        return await prepare_image(request.conn, request.ref, request.instance_dir, platform=request.platform)

    async def _spawn(self, launch: Launch) -> InstanceHandle:
        confinement = None
        if self.sandbox is not None:
            uid = self.sandbox.uid(launch.tenant_key)
            confinement = await asyncio.to_thread(self._confine, uid, launch)
        return await spawn(
            launch.command,
            cwd=launch.image.workdir,
            env=launch.env,
            instance_dir=launch.instance_dir,
            sandbox=self.sandbox,
            confinement=confinement,
        )

    @staticmethod
    def _confine(uid: int, launch: Launch) -> Confinement:
        """The instance's own files (an unpacked image: its root filesystem; a ``process://`` image: its
        directory, as it is) and its volumes, read-write; what the agent unpacked becomes the user's."""
        workdir = launch.image.workdir
        rootfs = launch.instance_dir / "rootfs"
        own = rootfs if workdir == rootfs or rootfs in workdir.parents else workdir
        if own == rootfs:
            give(rootfs, uid)
        volumes = tuple(path for path, _ in launch.plan.volumes.values())
        for path in volumes:
            give(path, uid)
        return Confinement(uid=uid, workdir=workdir, writable=(own, *volumes))

    async def adopt(self, record: InstanceRecord, instance_dir: Path) -> InstanceHandle | None:
        confined = None
        if record.sandbox_uid and self.sandbox is not None:
            workdir = Path(record.workdir)
            confined = Confined(self.sandbox, Confinement(record.sandbox_uid, workdir, (workdir,)), record.env)
        return adopt(record, poll_interval=self._poll_interval, confined=confined)

    async def sweep(self, keep: set[str]) -> None:
        return None  # a process leaves nothing behind but its instance directory (the runtime's own)

    async def prune_images(self) -> None:
        return None  # unpacked images live in the instance directories

    def retain_tenants(self, tenants: set[str]) -> None:
        if self.sandbox is not None:
            retain_tenant_uids(self.sandbox.uids, tenants)

    async def close(self) -> None:
        return None
