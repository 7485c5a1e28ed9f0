"""An applied ``zattera.toml`` (:mod:`cli.spec`) as the protobuf messages a release carries: its
``ServiceSpec`` and its route ``Middleware``."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from cli.spec import AppSpec, Env
from cli.spec_tables import Canary
from cli.spec_values import to_duration
from shared.jobs import POLICIES

_PROTOCOLS = {"http": pb.PROTOCOL_HTTP, "tcp": pb.PROTOCOL_TCP, "udp": pb.PROTOCOL_UDP}


_CHECKS = {
    "auto": pb.HEALTH_CHECK_TYPE_UNSPECIFIED,
    "http": pb.HEALTH_CHECK_TYPE_HTTP,
    "tcp": pb.HEALTH_CHECK_TYPE_TCP,
    "exec": pb.HEALTH_CHECK_TYPE_EXEC,
}


def service_spec(spec: AppSpec, env: Env) -> pb.ServiceSpec:
    s = pb.ServiceSpec(
        scale_to_zero=env.scale_to_zero,
        max_concurrency=env.max_concurrency,
        stateful=env.stateful,
        command=env.command or spec.run.command,
        read_only_root=env.read_only_root,
        release_command=env.release_command,
    )
    s.replicas.min = env.replicas.min
    s.replicas.max = env.replicas.max
    s.resources.cpu_millis = env.resources.cpu_millis
    s.resources.memory_mb = env.resources.memory_mb
    for port in env.ports:
        s.ports.add(
            name=port.name,
            container_port=port.container_port,
            protocol=_PROTOCOLS[port.protocol],
            public_l4_port=port.public_l4_port,
        )
    if env.healthcheck is not None:
        hc = env.healthcheck
        s.healthcheck.type = _CHECKS[hc.type]
        s.healthcheck.path = hc.path
        s.healthcheck.port = hc.port
        s.healthcheck.command = hc.command
        s.healthcheck.interval.CopyFrom(to_duration(hc.interval))
        s.healthcheck.timeout.CopyFrom(to_duration(hc.timeout))
        s.healthcheck.grace_period.CopyFrom(to_duration(hc.grace_period))
        s.healthcheck.unhealthy_threshold = hc.unhealthy_threshold
    if env.autoscale is not None:
        s.autoscale.target_cpu_percent = env.autoscale.target_cpu_percent
        s.autoscale.target_memory_percent = env.autoscale.target_memory_percent
        s.autoscale.target_rps_per_replica = env.autoscale.target_rps_per_replica
    for vol in env.volumes:
        s.volumes.add(volume_name=vol.volume_name, mount_path=vol.mount_path)
    s.placement_constraints.update(env.placement_constraints)
    if env.rate_limit is not None:
        s.rate_limit.requests_per_second = env.rate_limit.requests_per_second
        s.rate_limit.burst = env.rate_limit.burst
    s.stop_grace.CopyFrom(to_duration(env.stop_grace))
    if env.min_healthy_time is not None:
        s.min_healthy_time.CopyFrom(to_duration(env.min_healthy_time))
    if env.network.allow:
        s.network.allow.extend(env.network.allow)
    for entry in env.cron:
        cron = s.cron.add(
            name=entry.name,
            schedule=entry.schedule,
            command=entry.command,
            concurrency=POLICIES[entry.concurrency],
            max_retries=entry.max_retries,
        )
        cron.deadline.CopyFrom(to_duration(entry.deadline))
        if entry.resources is not None:
            cron.resources.cpu_millis = entry.resources.cpu_millis
            cron.resources.memory_mb = entry.resources.memory_mb
    if env.strategy == "canary":
        canary = env.canary or Canary()
        s.canary.steps.extend(canary.steps)
        s.canary.pause.CopyFrom(to_duration(canary.pause))
        s.canary.max_error_ratio = canary.max_error_ratio
        s.canary.max_latency_ratio = canary.max_latency_ratio
        s.canary.min_requests = canary.min_requests
    return s


def middleware(env: Env) -> pb.Middleware | None:
    """The env's ``Environment.middleware``; None when the file sets none."""
    if env.middleware is None:
        return None
    m = env.middleware
    out = pb.Middleware(
        ip_allowlist=m.ip_allowlist,
        max_body_bytes=m.max_body,
        sticky_sessions=m.sticky_sessions,
        redirect_https=m.redirect_https,
    )
    # The first user goes in the single-user fields a proxy of any version knows (one that predates
    # basic_auth_users then refuses everyone: it fails closed); the others in basic_auth_users.
    if m.basic_auth:
        out.basic_auth_username, out.basic_auth_password_hash = m.basic_auth[0].username, m.basic_auth[0].password_hash
    for user in m.basic_auth[1:]:
        out.basic_auth_users.add(username=user.username, password_hash=user.password_hash)
    return out
