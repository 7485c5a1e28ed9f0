"""Scaling reaction benchmark: how fast the autoscale service turns live data into an
``effective_replicas`` write, and how fast it answers an activation.

Setup: an embedded nats-server; 1,000 scale-to-zero envs with a CPU target of 50 % (min 1, max 10):
half warm (2 replicas, 2 RUN assignments each, spread over 500 nodes), half cold (0 replicas); and 500
serverless envs (``max_concurrency`` 10, min 1, max 10, at 1 replica). 500 nodes publish node heartbeats
every 5 s (their instances at 40 % CPU: at target); one proxy reports the warm envs' RPS and a second
one the serverless envs' in-flight and held requests (0: at target), each every 2 s (``zattera-live``
``proxy.<id>``); the autoscale service runs as its own process (``python -m services.autoscale``).

Figures:
* heartbeat → write: a node heartbeat reports 90 % CPU for one warm env's replicas (asks for 4); time
  until an observer's view sees the env's new ``effective_replicas`` (so the figure includes the
  observer's watch lag). One env per sample (each env then sits in its cooldown).
* proxy heartbeat → write (serverless): the second proxy's heartbeat reports 25 in flight and 10 held
  for one serverless env (ceil(35 / 10) = 4 replicas); time until the observer sees the serverless
  loop's ``effective_replicas`` write. One env per sample (its demand then stays up).
* Activate → write → reply: a ``zattera.activate`` request for a cold env, until its reply (the wake
  is committed before the reply).

Run: ``python -m benchmarks.scaling_bench`` (quick) or ``--full`` (more samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main
from shared import keys as K
from shared.activation import request_activation
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.live import publish_node_heartbeat, publish_proxy_heartbeat
from shared.provisioning import provision
from shared.state.changes import ChangeFeed
from shared.state.feed import StateView
from shared.txn import Writer

ENVS = 1000
SERVERLESS_ENVS = 500
SERVERLESS_CAP = 10
SPIKE_INFLIGHT = 25
SPIKE_HELD = 10
SPIKE_REPLICAS = 4  # ceil((25 + 10) / 10)
SERVERLESS_PROXY = "bench-proxy-serverless"
NODES = 500
NODE_PERIOD = 5.0
PROXY_PERIOD = 2.0
STEADY_CPU = 40.0
SPIKE_CPU = 90.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def _env(i: int, warm: bool) -> pb.Environment:
    env = pb.Environment(project_id="p", app_id="a", name=f"env-{i}", active_release_id=f"rel-{i:04d}")
    env.meta.id = f"env-{i:04d}"
    env.service.replicas.min = 1
    env.service.replicas.max = 10
    env.service.autoscale.target_cpu_percent = 50
    env.service.resources.memory_mb = 256
    env.service.scale_to_zero = True
    env.effective_replicas = 2 if warm else 0
    return env


def _serverless_env(i: int) -> pb.Environment:
    env = pb.Environment(project_id="p", app_id="s", name=f"sl-{i}", active_release_id=f"rel-sl-{i:04d}")
    env.meta.id = f"sl-{i:04d}"
    env.service.replicas.min = 1
    env.service.replicas.max = 10
    env.service.max_concurrency = SERVERLESS_CAP
    env.service.resources.memory_mb = 256
    env.effective_replicas = 1
    return env


def _objects() -> tuple[list[list[object]], dict[str, list[str]], dict[str, dict[str, float]]]:
    """Transactions to seed, env id -> assignment ids, node id -> {assignment id: cpu}."""
    txns: list[list[object]] = []
    env_assignments: dict[str, list[str]] = {}
    node_cpu: dict[str, dict[str, float]] = {f"node-{n:03d}": {} for n in range(NODES)}
    for n in range(NODES):
        node = pb.Node(status=pb.NODE_STATUS_ALIVE, schedulable=True)
        node.meta.id = f"node-{n:03d}"
        txns.append([node])
    for i in range(ENVS):
        warm = i % 2 == 0
        env = _env(i, warm)
        rel = pb.Release(environment_id=env.meta.id, version=1, image_ref="img:1")
        rel.meta.id = env.active_release_id
        objs: list[object] = [rel, env]
        if warm:
            for r in range(2):
                node_id = f"node-{(i + r * 7) % NODES:03d}"
                a = pb.Assignment(
                    node_id=node_id,
                    environment_id=env.meta.id,
                    release_id=rel.meta.id,
                    desired=pb.ASSIGNMENT_DESIRED_RUN,
                )
                a.meta.id = f"{env.meta.id}-a{r}"
                objs.append(a)
                env_assignments.setdefault(env.meta.id, []).append(a.meta.id)
                node_cpu[node_id][a.meta.id] = STEADY_CPU
        txns.append(objs)
    for i in range(SERVERLESS_ENVS):
        env = _serverless_env(i)
        rel = pb.Release(environment_id=env.meta.id, version=1, image_ref="img:1")
        rel.meta.id = env.active_release_id
        txns.append([rel, env])
    return txns, env_assignments, node_cpu


def _node_beat(node_id: str, cpu: dict[str, float]) -> cpb.Heartbeat:
    hb = cpb.Heartbeat(node_id=node_id)
    hb.time.GetCurrentTime()
    for aid, value in cpu.items():
        hb.instances[aid].CopyFrom(cpb.InstanceSample(cpu_percent=value, memory_bytes=64 << 20))
    return hb


async def _seed(conn: Connection, view: StateView, txns: list[list[object]]) -> None:
    writer = Writer(conn, view)
    batch = []
    for objs in txns:
        txn = writer.txn()
        for obj in objs:
            txn.create(obj)  # type: ignore[arg-type]
        batch.append(txn)
    results = await writer.commit_many(batch)
    assert all(r is None for r in results), "seeding failed"


async def _publish_nodes(conn: Connection, node_cpu: dict[str, dict[str, float]], stop: asyncio.Event) -> None:
    """Every node reports every NODE_PERIOD seconds, spread evenly over the period."""
    nodes = sorted(node_cpu)
    gap = NODE_PERIOD / len(nodes)
    while not stop.is_set():
        for node_id in nodes:
            if stop.is_set():
                return
            await publish_node_heartbeat(conn, _node_beat(node_id, node_cpu[node_id]))
            await asyncio.sleep(gap)


async def _publish_proxy(conn: Connection, stop: asyncio.Event) -> None:
    while not stop.is_set():
        hb = cpb.ProxyHeartbeat(proxy_id="bench-proxy", node_id="node-000")
        hb.time.GetCurrentTime()
        for i in range(0, ENVS, 2):
            hb.envs[f"env-{i:04d}"].CopyFrom(cpb.ProxySample(rps=5.0))
        await publish_proxy_heartbeat(conn, hb)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PROXY_PERIOD)


def _serverless_proxy_beat(demand: dict[str, tuple[int, int]]) -> cpb.ProxyHeartbeat:
    """The serverless proxy's heartbeat: every serverless env's (in flight, held) now."""
    hb = cpb.ProxyHeartbeat(proxy_id=SERVERLESS_PROXY, node_id="node-001")
    hb.time.GetCurrentTime()
    for env_id, (inflight, held) in demand.items():
        hb.envs[env_id].CopyFrom(cpb.ProxySample(inflight=inflight, held=held))
    return hb


async def _publish_serverless_proxy(conn: Connection, demand: dict[str, tuple[int, int]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await publish_proxy_heartbeat(conn, _serverless_proxy_beat(demand))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PROXY_PERIOD)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _wait_ready(conn: Connection, view: StateView, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if view.lease("autoscaler") is not None:
            with contextlib.suppress(Exception):
                await request_activation(conn, "env-0001", timeout=1.0)
                return
        await asyncio.sleep(0.2)
    raise RuntimeError("autoscale service did not become ready")


async def _until_scaled(feed: ChangeFeed, observer: StateView, env_id: str, replicas: int, start: float) -> float:
    """Seconds from ``start`` until the observer sees ``env_id`` at ``replicas`` effective replicas or more."""
    while True:
        await feed.wait(timeout=5.0)
        env = observer.env(env_id)
        if env is not None and env.effective_replicas >= replicas:
            return time.perf_counter() - start
        if time.perf_counter() - start > 10:
            raise RuntimeError(f"no scaling write for {env_id}")


async def _heartbeat_to_write(
    conn: Connection,
    observer: StateView,
    node_cpu: dict[str, dict[str, float]],
    env_assignments: dict[str, list[str]],
    samples: int,
) -> list[float]:
    feed = observer.subscribe({K.ENV})
    latencies: list[float] = []
    try:
        for env_id in sorted(env_assignments)[:samples]:
            node_id = observer.assignment(env_assignments[env_id][0])
            assert node_id is not None
            cpu = node_cpu[node_id.node_id]
            for aid in env_assignments[env_id]:
                if aid in cpu:
                    cpu[aid] = SPIKE_CPU
            feed.drain()
            start = time.perf_counter()
            await publish_node_heartbeat(conn, _node_beat(node_id.node_id, cpu))
            latencies.append(await _until_scaled(feed, observer, env_id, 3, start))
            await asyncio.sleep(0.03)
    finally:
        feed.close()
    return latencies


async def _proxy_to_write(
    conn: Connection, observer: StateView, demand: dict[str, tuple[int, int]], samples: int
) -> list[float]:
    """Per sample: one serverless env's demand crosses its threshold in a proxy heartbeat; until its write."""
    feed = observer.subscribe({K.ENV})
    latencies: list[float] = []
    try:
        for env_id in sorted(demand)[:samples]:
            demand[env_id] = (SPIKE_INFLIGHT, SPIKE_HELD)
            feed.drain()
            start = time.perf_counter()
            await publish_proxy_heartbeat(conn, _serverless_proxy_beat(demand))
            latencies.append(await _until_scaled(feed, observer, env_id, SPIKE_REPLICAS, start))
            await asyncio.sleep(0.01)
    finally:
        feed.close()
    return latencies


async def _activate(conn: Connection, samples: int) -> list[float]:
    latencies = []
    cold = [f"env-{i:04d}" for i in range(1, ENVS, 2)][:samples]
    for env_id in cold:
        start = time.perf_counter()
        reply = await request_activation(conn, env_id, "bench", timeout=5.0)
        latencies.append(time.perf_counter() - start)
        assert reply.accepted
        await asyncio.sleep(0.01)
    return latencies


async def _run(quick: bool) -> list[dict[str, object]]:
    samples = 100 if quick else 450
    with tempfile.TemporaryDirectory(prefix="zattera-scaling-bench-") as tmp:
        server = EmbeddedNats(data_dir=Path(tmp) / "nats").start()
        service: asyncio.subprocess.Process | None = None
        conn = await connect(server.url, name="scaling-bench")
        stop = asyncio.Event()
        publishers: list[asyncio.Task[None]] = []
        observer = StateView(conn, name="bench-observer")
        try:
            await provision(conn.js)
            await observer.start()
            txns, env_assignments, node_cpu = _objects()
            await _seed(conn, observer, txns)
            demand = {_serverless_env(i).meta.id: (0, 0) for i in range(SERVERLESS_ENVS)}
            publishers = [
                asyncio.create_task(_publish_nodes(conn, node_cpu, stop)),
                asyncio.create_task(_publish_proxy(conn, stop)),
                asyncio.create_task(_publish_serverless_proxy(conn, demand, stop)),
            ]
            env = {**os.environ, "ZATTERA_NATS_URL": server.url}
            service = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.autoscale", "--log-level", "WARNING", env=env, cwd=REPO_ROOT
            )
            await _wait_ready(conn, observer)
            await asyncio.sleep(NODE_PERIOD)  # every node has reported once: steady state
            hb_latencies = await _heartbeat_to_write(conn, observer, node_cpu, env_assignments, samples)
            proxy_latencies = await _proxy_to_write(conn, observer, demand, samples)
            act_latencies = await _activate(conn, samples)
        finally:
            stop.set()
            for task in publishers:
                task.cancel()
            await asyncio.gather(*publishers, return_exceptions=True)
            if service is not None and service.returncode is None:
                service.terminate()
                try:
                    await asyncio.wait_for(service.wait(), 10)
                except TimeoutError:
                    service.kill()
                    await service.wait()
            await observer.stop()
            await conn.close()
            server.stop()
    hb_ms = [x * 1000 for x in hb_latencies]
    proxy_ms = [x * 1000 for x in proxy_latencies]
    act_ms = [x * 1000 for x in act_latencies]
    anchor_hb = "Knative panic window 6 s; Kubernetes HPA sync 15 s; reference tick 15 s"
    anchor_proxy = "Knative panic window 6 s; reference serverless tick 5 s on in-flight sampled every 15 s"
    anchor_act = "reference: per-call gRPC dial to the leader + Raft apply"
    return [
        {"figure": "heartbeat→write p50", "value": round(statistics.median(hb_ms), 1), "unit": "ms",
         "target": "", "anchor": anchor_hb},
        {"figure": "heartbeat→write p99", "value": round(_p(hb_ms, 0.99), 1), "unit": "ms",
         "target": "≤ 1000", "anchor": anchor_hb},
        {"figure": "proxy heartbeat→write p50 (serverless)", "value": round(statistics.median(proxy_ms), 1),
         "unit": "ms", "target": "", "anchor": anchor_proxy},
        {"figure": "proxy heartbeat→write p99 (serverless)", "value": round(_p(proxy_ms, 0.99), 1),
         "unit": "ms", "target": "≤ 1000", "anchor": anchor_proxy},
        {"figure": "Activate→write→reply p50", "value": round(statistics.median(act_ms), 1), "unit": "ms",
         "target": "", "anchor": anchor_act},
        {"figure": "Activate→write→reply p99", "value": round(_p(act_ms, 0.99), 1), "unit": "ms",
         "target": "≤ 50", "anchor": anchor_act},
        {"figure": "samples per figure", "value": len(hb_ms), "unit": "", "target": "",
         "anchor": f"{ENVS} envs + {SERVERLESS_ENVS} serverless, {NODES} nodes every {NODE_PERIOD:g} s, "
                   f"2 proxies every {PROXY_PERIOD:g} s"},
    ]  # fmt: skip


def run(quick: bool = True) -> list[dict[str, object]]:
    return asyncio.run(_run(quick))


def main() -> None:
    bench_main("Scaling", run, __doc__, "more samples")


if __name__ == "__main__":
    main()
