"""Builders for the scheduler tests, on top of tests/factories.py (the spec's rigs)."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from tests.factories import node


def pnode(node_id: str, region: str = "", cpu: int = 1000, mem: int = 1024, **kw: object) -> pb.Node:
    """The spec's ``pnode``: ALIVE, schedulable worker, region label when given, capacity cpu/mem."""
    return node(node_id, region=region, cpu=cpu, mem=mem, **kw)  # type: ignore[arg-type]


def unlimited(node_id: str, **kw: object) -> pb.Node:
    """The spec's ``addNodes``: ALIVE, schedulable, WORKER, no capacity (unlimited), no labels."""
    return node(node_id, cpu=0, mem=0, **kw)  # type: ignore[arg-type]


def spec_release(
    release_id: str,
    env_id: str,
    *,
    cpu: int = 0,
    mem: int = 0,
    min_replicas: int = 1,
    max_replicas: int = 0,
    stateful: bool = False,
    volumes: tuple[str, ...] = (),
    platforms: tuple[str, ...] = (),
    constraints: dict[str, str] | None = None,
    config_hash: str = "hash-v1",
    image: str = "img:1",
) -> pb.Release:
    r = pb.Release(environment_id=env_id, image_ref=image, config_hash=config_hash, version=1)
    r.meta.id = release_id
    s = r.service
    s.resources.cpu_millis = cpu
    s.resources.memory_mb = mem
    s.replicas.min = min_replicas
    s.replicas.max = max_replicas or min_replicas + 5
    s.stateful = stateful
    for name in volumes:
        s.volumes.add(volume_name=name, mount_path=f"/{name}")
    r.platforms.extend(platforms)
    s.placement_constraints.update(constraints or {})
    return r


def spec_env(
    env_id: str,
    release: pb.Release | None,
    *,
    project_id: str = "",
    app_id: str = "",
    min_replicas: int | None = None,
    effective: int = 0,
    scale_to_zero: bool = False,
) -> pb.Environment:
    """``addEnvRelease``: the env's live spec is the release's spec; active = the release (if any)."""
    e = pb.Environment(project_id=project_id, app_id=app_id, name="production", effective_replicas=effective)
    e.meta.id = env_id
    if release is not None:
        e.service.CopyFrom(release.service)
        e.active_release_id = release.meta.id
    if min_replicas is not None:
        e.service.replicas.min = min_replicas
    e.service.scale_to_zero = scale_to_zero
    return e


def volume(
    volume_id: str,
    env_id: str,
    name: str,
    node_id: str,
    *,
    project_id: str = "p1",
    status: int = pb.VOLUME_STATUS_ACTIVE,
) -> pb.Volume:
    v = pb.Volume(project_id=project_id, environment_id=env_id, name=name, node_id=node_id, status=status)  # type: ignore[arg-type]
    v.meta.id = volume_id
    return v


def deployment(
    deployment_id: str, env_id: str, release_id: str, previous: str = "", phase: int = pb.DEPLOYMENT_PHASE_PENDING
) -> pb.Deployment:
    d = pb.Deployment(environment_id=env_id, release_id=release_id, previous_release_id=previous, phase=phase)  # type: ignore[arg-type]
    d.meta.id = deployment_id
    return d
