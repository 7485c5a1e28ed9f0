"""Route test state: the spec's C1 seed (routes-snapshots.md C1) as (key, message) writes.

The same writes feed a connection-less :func:`write_local` (pure builder tests) or real NATS through a
:class:`Writer` (:func:`commit`).
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.txn import Writer
from tests.memory_state import MemoryState

Write = tuple[str, Message | None]  # None = delete
DOMAIN = "apps.example.com"


def project(project_id: str = "proj", name: str = "demo") -> Write:
    msg = pb.Project(name=name)
    msg.meta.id = project_id
    return K.project(project_id), msg


def app(app_id: str = "app", name: str = "api", project_id: str = "proj") -> Write:
    msg = pb.App(project_id=project_id, name=name)
    msg.meta.id = app_id
    return K.app(app_id), msg


def env(
    env_id: str = "env1",
    *,
    app_id: str = "app",
    project_id: str = "proj",
    name: str = "production",
    active_release_id: str = "relA",
    ports: Iterable[pb.PortSpec] | None = None,
    route_generation: int = 1,
    **service: object,
) -> Write:
    msg = pb.Environment(
        app_id=app_id,
        project_id=project_id,
        name=name,
        active_release_id=active_release_id,
        route_generation=route_generation,
    )
    msg.meta.id = env_id
    msg.service.ports.extend([http_port()] if ports is None else list(ports))
    for field, value in service.items():
        if isinstance(value, Message):
            getattr(msg.service, field).CopyFrom(value)
        else:
            setattr(msg.service, field, value)
    return K.env(env_id), msg


def http_port(name: str = "http", container_port: int = 8080) -> pb.PortSpec:
    return pb.PortSpec(name=name, container_port=container_port, protocol=pb.PROTOCOL_HTTP)


def node(node_id: str = "n1", *, status: int = pb.NODE_STATUS_ALIVE, mesh_ip: str = "10.90.0.1") -> Write:
    msg = pb.Node(status=status, mesh_ip=mesh_ip)  # type: ignore[arg-type]
    msg.meta.id = node_id
    return K.node(node_id), msg


def domain(
    domain_id: str = "dom1",
    hostname: str = "api.example.com",
    *,
    env_id: str = "env1",
    project_id: str = "proj",
    path_prefix: str = "",
    port_name: str = "",
    middleware: pb.Middleware | None = None,
) -> Write:
    msg = pb.Domain(
        project_id=project_id,
        environment_id=env_id,
        hostname=hostname,
        path_prefix=path_prefix,
        port_name=port_name,
        middleware=middleware,
    )
    msg.meta.id = domain_id
    return K.domain(domain_id), msg


def vip(env_id: str = "env1", address: str = "127.128.0.5") -> Write:
    return K.vip(env_id), pb.ServiceVIP(environment_id=env_id, vip=address)


def assignment(
    assignment_id: str,
    release_id: str = "relA",
    bindings: dict[str, int] | None = None,
    *,
    env_id: str = "env1",
    node_id: str = "n1",
    desired: int = pb.ASSIGNMENT_DESIRED_RUN,
    state: int = pb.INSTANCE_STATE_HEALTHY,
) -> list[Write]:
    """An assignment plus its agent's report (the published mesh ports travel in the report)."""
    desired_part = pb.Assignment(
        node_id=node_id,
        project_id="proj",
        app_id="app",
        environment_id=env_id,
        release_id=release_id,
        desired=desired,  # type: ignore[arg-type]
    )
    desired_part.meta.id = assignment_id
    report = pb.AssignmentObserved(state=state, mesh_port_bindings=bindings or {})  # type: ignore[arg-type]
    return [(K.assignment(node_id, assignment_id), desired_part), (K.observed(node_id, assignment_id), report)]


def healthy_assignment(assignment_id: str, release_id: str, port: int, **kw: object) -> list[Write]:
    return assignment(assignment_id, release_id, {"http": port}, **kw)  # type: ignore[arg-type]


def seed_route_env() -> list[Write]:
    return [project(), app(), env(), node()]


def write_local(state: MemoryState, *writes: Write | list[Write]) -> int:
    """Apply writes to a store filled directly (pure builder tests); returns the last revision."""
    for item in writes:
        for key, msg in item if isinstance(item, list) else [item]:
            state.write(key, msg)
    return state.revision


async def commit(writer: Writer, *writes: Write | list[Write]) -> None:
    """Write to the real bucket in one atomic batch (unfenced)."""
    txn = writer.txn("test")
    for item in writes:
        for key, msg in item if isinstance(item, list) else [item]:
            if msg is None:
                txn.delete(key)
            else:
                txn.put(msg, key=key)
    await writer.commit(txn)
