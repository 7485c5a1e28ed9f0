"""The route snapshot built the straightforward way: generated message objects, A1 rule by rule, then
protobuf's deterministic serializer. The reference for the builder's hand-written encoding
(``test_wire.py``) and its speed (``benchmarks/routes_bench.py``)."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.env_routes import (
    L4_PROTOCOL,
    http_port_name,
    implicit_hostname,
    internal_fqdn,
    node_hosts,
    routable_replicas,
    routes_http,
)
from shared.state.reader import StateReader
from shared.version import VERSION


def reference_content(view: StateReader, domain: str) -> bytes:
    """The version-less snapshot built with message objects, serialized by protobuf."""
    snapshot = cpb.RouteSnapshot()
    hosts = node_hosts(view)
    for env in sorted(view.envs(), key=lambda e: e.meta.id):
        sections = reference_env(view, env, domain, hosts)
        if sections is not None:
            snapshot.MergeFrom(sections)
    snapshot.cert_hosts.extend(sorted({route.hostname for route in snapshot.http_routes}))
    snapshot.control_version = VERSION
    return snapshot.SerializeToString(deterministic=True)


def reference_env(
    view: StateReader, env: pb.Environment, domain: str, hosts: dict[str, str | None]
) -> cpb.RouteSnapshot | None:
    app = view.app(env.app_id)
    if app is None:
        return None
    env_id, project_id, spec = env.meta.id, env.project_id, env.service
    replicas = routable_replicas(view, env, hosts)

    def endpoints(port_name: str) -> list[cpb.Endpoint]:
        found = []
        for assignment, observed, host in replicas:
            port = observed.mesh_port_bindings.get(port_name, 0) or assignment.mesh_port_bindings.get(port_name, 0)
            if port:
                found.append(
                    cpb.Endpoint(
                        assignment_id=assignment.meta.id,
                        node_id=assignment.node_id,
                        addr=f"{host}:{port}",
                        healthy=True,
                    )
                )
        return found

    ids = {
        "project_id": project_id,
        "app_id": env.app_id,
        "environment_id": env_id,
        "app_name": app.name,
        "environment_name": env.name,
    }
    flags = {
        "scale_to_zero": spec.scale_to_zero,
        "max_concurrency": spec.max_concurrency,
        "route_generation": env.route_generation,
        "rate_limit": spec.rate_limit if spec.HasField("rate_limit") else None,
    }
    sections = cpb.RouteSnapshot()
    for dom in view.domains(env_id):
        if dom.project_id == project_id and routes_http(spec, dom.port_name or http_port_name(spec)):
            sections.http_routes.add(
                hostname=dom.hostname,
                path_prefix=dom.path_prefix,
                middleware=dom.middleware if dom.HasField("middleware") else None,
                endpoints=endpoints(dom.port_name or http_port_name(spec)),
                **ids,  # type: ignore[arg-type]
                **flags,  # type: ignore[arg-type]
            )
    if domain and http_port_name(spec):
        sections.http_routes.add(
            hostname=implicit_hostname(app.name, env.name, domain),
            endpoints=endpoints(http_port_name(spec)),
            **ids,  # type: ignore[arg-type]
            **flags,  # type: ignore[arg-type]
        )
    for port in spec.ports:
        if port.public_l4_port:
            sections.l4_routes.add(
                public_port=port.public_l4_port,
                protocol=L4_PROTOCOL,
                environment_id=env_id,
                endpoints=endpoints(port.name),
            )
    vip = view.vip(env_id)
    if vip is not None and vip.vip:
        project = view.project(project_id)
        service = sections.internal_services.add(
            fqdn=internal_fqdn(app.name, env.name, project.name if project is not None else project_id),
            project_id=project_id,
            environment_id=env_id,
            vip=vip.vip,
            scale_to_zero=spec.scale_to_zero,
        )
        for port in spec.ports:
            service.ports.add(
                name=port.name, port=port.container_port, protocol=L4_PROTOCOL, endpoints=endpoints(port.name)
            )
    return sections
