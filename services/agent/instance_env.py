"""What an instance is started with: its config identity, environment, ports, volumes and limits (pure).

Shared by both runtimes (``launchers.py``, ``docker_runtime.py``) through the supervisor (``runtime.py``);
the rules are described in the runtime's module docstring.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from services.agent.health import LOOPBACK
from services.agent.images import PreparedImage
from services.agent.launchers import LaunchPlan
from services.agent.settings import AgentSettings
from shared.ids import is_safe_id, unsafe_id
from shared.state.reader import StateReader
from shared.volumes import lease_expired, lease_of

DEFAULT_PORT_NAME = "http"
PASSED_THROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")


def config_of(a: pb.Assignment, release: pb.Release) -> str:
    """What a running process was started from; any change means recreate it."""
    return f"{a.release_id}|{a.config_hash or release.config_hash}|{release.image_ref}"


def port_names(spec: pb.ServiceSpec) -> list[str]:
    names = list(dict.fromkeys(p.name or DEFAULT_PORT_NAME for p in spec.ports))
    return names or [DEFAULT_PORT_NAME]


def _env_name(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", name.upper())


def volume_env_name(volume_name: str) -> str:
    return f"ZATTERA_VOLUME_{_env_name(volume_name)}"


def lease_is_ours(volume: pb.Volume, node_id: str, assignment_id: str, now: float) -> bool:
    lease = lease_of(volume)
    return (
        lease is not None
        and not lease_expired(lease, now)
        and lease.node_id == node_id
        and lease.assignment_id == assignment_id
    )


def resolve_volumes(
    view: StateReader, a: pb.Assignment, release: pb.Release, volumes_dir: Path, now: float
) -> tuple[dict[str, Path], str]:
    """The volume directories of a stateful instance by volume name, or why it cannot start yet. A volume
    whose id is not a plain id (``..``, ``/``) never starts: its directory would lie outside the volumes
    directory (the Docker socket's, the agent's data), mounted into the instance and given to its user."""
    if not release.service.stateful:
        return {}, ""
    paths: dict[str, Path] = {}
    for mount in release.service.volumes:
        volume = next(
            (v for v in view.volumes(a.environment_id) if v.project_id == a.project_id and v.name == mount.volume_name),
            None,
        )
        if volume is None:
            return {}, f"waiting for volume {mount.volume_name}"
        if not lease_is_ours(volume, a.node_id, a.meta.id, now):
            return {}, f"waiting for the lease of volume {mount.volume_name}"
        if not is_safe_id(volume.meta.id):  # it names the directory mounted into the instance
            return {}, f"volume {mount.volume_name}: {unsafe_id('volume id', volume.meta.id)}"
        paths[mount.volume_name] = volumes_dir / volume.meta.id
    return paths, ""


def bind_address(settings: AgentSettings) -> str:
    """Where this node's instances listen: its mesh address (what routes list for its replicas, and what
    other nodes' proxies connect to), else loopback for a single machine."""
    return settings.mesh_ip or LOOPBACK


def instance_env(
    a: pb.Assignment,
    image: PreparedImage,
    ports: Mapping[str, int],
    volumes: Mapping[str, Path],
    config: Mapping[str, str] = {},
    *,
    bind: str = LOOPBACK,
) -> dict[str, str]:
    """The process environment: the image's, then the env's variables and secrets (``config``), then what the
    platform sets (PORT, PORT_*, ZATTERA_*: reserved names, so config cannot shadow them anyway)."""
    env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
    env.update(image.env)
    env.update(config)
    # Where to listen, with PORT: the node's mesh address. HOST too (what many frameworks read), unless
    # the image sets its own.
    env.setdefault("HOST", bind)
    env["ZATTERA_BIND_ADDR"] = bind
    env.update(
        ZATTERA_NODE_ID=a.node_id,
        ZATTERA_ASSIGNMENT_ID=a.meta.id,
        ZATTERA_PROJECT_ID=a.project_id,
        ZATTERA_APP_ID=a.app_id,
        ZATTERA_ENVIRONMENT_ID=a.environment_id,
        ZATTERA_RELEASE_ID=a.release_id,
    )
    for name, port in ports.items():
        env[f"PORT_{_env_name(name)}"] = str(port)
    env["PORT"] = str(ports.get(DEFAULT_PORT_NAME) or next(iter(ports.values())))
    for name, path in volumes.items():
        env[volume_env_name(name)] = str(path)
    return env


def launch_plan(release: pb.Release, volumes: Mapping[str, Path]) -> LaunchPlan:
    mount_paths = {m.volume_name: m.mount_path for m in release.service.volumes}
    return LaunchPlan(
        memory_mb=release.service.resources.memory_mb,
        cpu_millis=release.service.resources.cpu_millis,
        read_only_root=release.service.read_only_root,
        volumes={name: (path, mount_paths.get(name) or f"/volumes/{name}") for name, path in volumes.items()},
        tenant=release.environment_id,
    )
