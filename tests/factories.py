"""Small builders for state objects used across tests."""

from __future__ import annotations

import io
import tarfile

from zattera.v1 import types_pb2 as pb

from shared.ids import new_id


def node(
    node_id: str,
    *,
    cpu: int = 4000,
    mem: int = 8192,
    region: str = "",
    status: int = pb.NODE_STATUS_ALIVE,
    schedulable: bool = True,
    os_arch: str = "linux/amd64",
    labels: dict[str, str] | None = None,
    roles: tuple[int, ...] = (pb.NODE_ROLE_WORKER,),
) -> pb.Node:
    n = pb.Node(status=status, schedulable=schedulable, os_arch=os_arch)  # type: ignore[arg-type]
    n.meta.id = node_id
    n.capacity.cpu_millis = cpu
    n.capacity.memory_mb = mem
    if region:
        n.labels["region"] = region
    n.labels.update(labels or {})
    n.roles.extend(roles)  # type: ignore[arg-type]
    return n


def env(
    env_id: str, *, project_id: str = "p1", app_id: str = "a1", min_replicas: int = 1, active_release_id: str = ""
) -> pb.Environment:
    e = pb.Environment(project_id=project_id, app_id=app_id, active_release_id=active_release_id)
    e.meta.id = env_id
    e.service.replicas.min = min_replicas
    return e


def release(release_id: str, env_id: str, *, cpu: int = 0, mem: int = 0, version: int = 1) -> pb.Release:
    r = pb.Release(environment_id=env_id, version=version, image_ref="img:1")
    r.meta.id = release_id
    r.service.resources.cpu_millis = cpu
    r.service.resources.memory_mb = mem
    return r


def assignment(
    node_id: str,
    env_id: str,
    release_id: str,
    *,
    assignment_id: str | None = None,
    desired: int = pb.ASSIGNMENT_DESIRED_RUN,
) -> pb.Assignment:
    a = pb.Assignment(node_id=node_id, environment_id=env_id, release_id=release_id, desired=desired)  # type: ignore[arg-type]
    a.meta.id = assignment_id or new_id()
    return a


def source_tarball(files: dict[str, str]) -> bytes:
    """A gzipped source tarball holding ``files`` (name -> text), as `zattera deploy` uploads."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, text in files.items():
            body = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return raw.getvalue()
