"""State objects for the builds tests (the reference fixtures seedBuilder / seedBuild / seedReleases)."""

from __future__ import annotations

from collections.abc import Sequence

from zattera.v1 import types_pb2 as pb

from shared.clock import to_timestamp
from tests import factories


def builder_node(
    node_id: str,
    *,
    cordoned: bool = False,
    os_arch: str = "linux/amd64",
    status: int = pb.NODE_STATUS_ALIVE,
    labels: dict[str, str] | None = None,
) -> pb.Node:
    return factories.node(
        node_id,
        schedulable=not cordoned,
        os_arch=os_arch,
        status=status,
        labels={"builder": "true", **(labels or {})},
    )


def build(
    build_id: str,
    *,
    status: int = pb.BUILD_STATUS_QUEUED,
    platforms: Sequence[str] = (),
    tarball_digest: str = "sha256:deadbeef",
    node_id: str = "",
    last_event_at: float | None = None,
) -> pb.Build:
    b = pb.Build(
        app_id="app1",
        project_id="proj1",
        environment_id="env1",
        status=status,  # type: ignore[arg-type]
        tarball_digest=tarball_digest,
        node_id=node_id,
        platforms=list(platforms),
    )
    b.meta.id = build_id
    if last_event_at is not None:
        b.started_at.CopyFrom(to_timestamp(last_event_at))
        b.last_event_at.CopyFrom(to_timestamp(last_event_at))
    return b


def release(
    n: int, *, env_id: str = "env", build_id: str | None = None, image_ref: str = "", project: str = "proj"
) -> pb.Release:
    r = pb.Release(environment_id=env_id, project_id=project, app_id="app", version=n, image_ref=image_ref)
    r.meta.id = f"rel-{n}"
    r.source.build_id = f"build-{n}" if build_id is None else build_id
    return r


def deployment(
    deployment_id: str, release_id: str, phase: int, *, env_id: str = "env", build_id: str = "", previous: str = ""
) -> pb.Deployment:
    d = pb.Deployment(
        environment_id=env_id,
        release_id=release_id,
        phase=phase,  # type: ignore[arg-type]
        build_id=build_id,
        previous_release_id=previous,
    )
    d.meta.id = deployment_id
    return d
