"""Builders for the scaling tests: envs with a scaling spec, node/proxy heartbeats, offline views."""

from __future__ import annotations

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.clock import Clock
from shared.live import LiveView, node_key, proxy_key
from tests.factories import assignment, release

ENV = "env1"
REL = "rel1"
MIB = 1_048_576


def scaled_env(
    env_id: str = ENV,
    *,
    min_replicas: int = 1,
    max_replicas: int = 5,
    cpu: int = 0,
    memory: int = 0,
    rps: int = 0,
    memory_mb: int = 100,
    scale_to_zero: bool = False,
    stateful: bool = False,
    max_concurrency: int = 0,
    effective: int = 0,
    idle_timeout: float | None = None,
    active_release_id: str = REL,
) -> pb.Environment:
    env = pb.Environment(project_id="p1", app_id="a1", name="production", active_release_id=active_release_id)
    env.meta.id = env_id
    spec = env.service
    spec.replicas.min = min_replicas
    spec.replicas.max = max_replicas
    spec.autoscale.target_cpu_percent = cpu
    spec.autoscale.target_memory_percent = memory
    spec.autoscale.target_rps_per_replica = rps
    spec.resources.memory_mb = memory_mb
    spec.scale_to_zero = scale_to_zero
    spec.stateful = stateful
    spec.max_concurrency = max_concurrency
    env.effective_replicas = effective
    if idle_timeout is not None:
        env.idle_timeout.FromNanoseconds(int(idle_timeout * 1e9))
    return env


def running(count: int, env_id: str = ENV, node_id: str = "n1") -> list[pb.Assignment]:
    return [assignment(node_id, env_id, REL, assignment_id=f"{env_id}-a{i}") for i in range(count)]


def deployment(dep_id: str, env_id: str = ENV, phase: int = pb.DEPLOYMENT_PHASE_STARTING) -> pb.Deployment:
    d = pb.Deployment(environment_id=env_id, release_id=REL, phase=phase)  # type: ignore[arg-type]
    d.meta.id = dep_id
    return d


def stamp(ts: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(ts * 1e9))
    return t


def traffic(
    *, inflight: int = 0, held: int = 0, rps: float = 0.0, last_request_at: float | None = None
) -> cpb.ProxySample:
    sample = cpb.ProxySample(inflight=inflight, held=held, rps=rps)
    if last_request_at is not None:
        sample.last_request_at.CopyFrom(stamp(last_request_at))
    return sample


def node_beat(
    now: float,
    node_id: str = "n1",
    *,
    instances: dict[str, tuple[float, int]] | None = None,
    proxy: dict[str, cpb.ProxySample] | None = None,
) -> cpb.Heartbeat:
    """A node heartbeat sent at ``now``: ``instances`` maps assignment id -> (cpu %, memory bytes)."""
    hb = cpb.Heartbeat(node_id=node_id, time=stamp(now))
    for aid, (cpu, mem) in (instances or {}).items():
        hb.instances[aid].CopyFrom(cpb.InstanceSample(cpu_percent=cpu, memory_bytes=mem))
    for env_id, sample in (proxy or {}).items():
        hb.proxy[env_id].CopyFrom(sample)
    return hb


def usage_beat(
    now: float, assignments: list[pb.Assignment], *, cpu: float, rps: float = 0.0, mem: int = 10 * MIB
) -> cpb.Heartbeat:
    """The reference's ``heartbeat(cpu, rps)``: every assignment at ``cpu``, 10 MiB, env rps."""
    return node_beat(now, instances={a.meta.id: (cpu, mem) for a in assignments}, proxy={ENV: traffic(rps=rps)})


def proxy_beat(now: float, proxy_id: str = "p1", envs: dict[str, cpb.ProxySample] | None = None) -> cpb.ProxyHeartbeat:
    hb = cpb.ProxyHeartbeat(proxy_id=proxy_id, node_id="n1", time=stamp(now))
    for env_id, sample in (envs or {}).items():
        hb.envs[env_id].CopyFrom(sample)
    return hb


def offline_live(clock: Clock, *beats: cpb.Heartbeat | cpb.ProxyHeartbeat) -> LiveView:
    live = LiveView(None, clock)
    for hb in beats:
        key = node_key(hb.node_id) if isinstance(hb, cpb.Heartbeat) else proxy_key(hb.proxy_id)
        live.apply(key, hb.SerializeToString())
    return live


def base_objects(env: pb.Environment, assignments: list[pb.Assignment] | None = None) -> list[Message]:
    return [release(REL, env.meta.id), env, *(assignments or [])]
