"""Route snapshot benchmark: build cost, incremental rebuild, and write-to-proxy propagation.

``python -m benchmarks.routes_bench [--full]``. Figures:

* full build of N envs × 3 healthy endpoints, each env with an implicit HTTP route and an internal
  service (a VIP, as every env with a port gets one), N = 1k / 5k / 10k (target at 10k: ≤ 200 ms);
* the same 10k snapshot built from protobuf message objects and serialized by protobuf (the builder's
  reference in the tests), side by side with the hand-written encoding;
* the floor under the encoding: the same 10k envs' inputs only read from the view's protobuf messages (every
  field the build reads, nothing encoded), beside the full build in alternating rounds, CPU time;
* incremental rebuild at 10k after one replica's observed state changes (target ≤ 10 ms): the
  affected env rebuilt plus the new snapshot bytes assembled;
* the 10k-env snapshot on the wire: serialized size, zstd size, messages; and through a real
  nats-server to a :class:`RouteClient` (zstd in one message, and uncompressed in 256 KiB chunks);
* propagation at 1k envs through a real nats-server: from an assignment's observed HEALTHY write to a
  subscribed :class:`RouteClient` holding a snapshot with that endpoint (targets p50 ≤ 100 ms, p99 ≤ 250 ms;
  the reference waits a fixed 200 ms debounce, and its 15 s tick for anything it missed).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main
from services.routes.builder import RouteBuilder
from services.routes.env_routes import encode_snapshot, node_hosts
from services.routes.publisher import RoutesPublisher
from shared import keys as K
from shared.clock import RealClock
from shared.connection import connect
from shared.embedded import MAX_PAYLOAD, EmbeddedNats
from shared.provisioning import provision
from shared.routeclient import RouteClient
from shared.routewire import COMPRESS_ABOVE, HEADER_ROOM, content_digest, encode_messages
from shared.state.feed import StateView
from shared.state.store import StateStore
from shared.subjects import ROUTES_SNAPSHOT_SUBJECT
from shared.txn import Writer
from tests.routes.reference import reference_content

DOMAIN = "apps.example.com"
NODES = 50
REPLICAS = 3
ENVS_10K = 10_000

Row = dict[str, object]


def cluster_writes(envs: int) -> list[tuple[str, object]]:
    """(key, message) of a cluster with ``envs`` envs, each with 3 HEALTHY replicas and a VIP."""
    writes: list[tuple[str, object]] = []
    project = pb.Project(name="bench")
    project.meta.id = "P" * 26
    writes.append((K.project(project.meta.id), project))
    for n in range(NODES):
        node = pb.Node(status=pb.NODE_STATUS_ALIVE, mesh_ip=f"10.90.0.{n + 1}")
        node.meta.id = f"N{n:025d}"
        writes.append((K.node(node.meta.id), node))
    for i in range(envs):
        app = pb.App(project_id=project.meta.id, name=f"app{i}")
        app.meta.id = f"A{i:025d}"
        env = pb.Environment(
            app_id=app.meta.id, project_id=project.meta.id, name="production", active_release_id="R" * 26
        )
        env.meta.id = f"E{i:025d}"
        env.service.ports.add(name="http", container_port=8080, protocol=pb.PROTOCOL_HTTP)
        writes += [(K.app(app.meta.id), app), (K.env(env.meta.id), env)]
        writes.append(
            (K.vip(env.meta.id), pb.ServiceVIP(environment_id=env.meta.id, vip=f"127.128.{i // 253}.{i % 253 + 2}"))
        )
        for r in range(REPLICAS):
            node_id = f"N{(i * REPLICAS + r) % NODES:025d}"
            a = pb.Assignment(
                node_id=node_id,
                environment_id=env.meta.id,
                release_id=env.active_release_id,
                desired=pb.ASSIGNMENT_DESIRED_RUN,
            )
            a.meta.id = f"S{i:023d}{r:03d}"
            observed = pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY, mesh_port_bindings={"http": 30000 + r})
            writes += [(K.assignment(node_id, a.meta.id), a), (K.observed(node_id, a.meta.id), observed)]
    return writes


def local_view(envs: int) -> StateStore:
    view = StateStore()
    for revision, (key, msg) in enumerate(cluster_writes(envs), start=1):
        view.apply_local(key, revision, msg)  # type: ignore[arg-type]
    return view


def timed(fn: object, repeat: int) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def read_inputs(view: StateStore) -> int:
    """Every field a full build reads, read and dropped: the cost of the inputs without any encoding."""
    hosts = node_hosts(view)
    seen = 0
    for env in view.envs():
        app = view.app(env.app_id)
        assert app is not None
        _ = (env.meta.id, env.project_id, env.app_id, env.name, app.name, env.active_release_id)
        spec = env.service
        for port in spec.ports:
            _ = (port.name, port.protocol, port.public_l4_port, port.container_port)
        _ = (spec.scale_to_zero, spec.max_concurrency, env.route_generation, spec.HasField("rate_limit"))
        _ = env.HasField("middleware")
        for dom in view.domains(env.meta.id):
            _ = (dom.project_id, dom.hostname, dom.port_name)
        vip = view.vip(env.meta.id)
        project = view.project(env.project_id)
        _ = (vip.vip if vip else "", project.name if project else "")
        for a in view.assignments(env.meta.id):
            observed = a.observed
            _ = (a.release_id, a.desired, observed.state, hosts.get(a.node_id), a.meta.id, a.node_id)
            _ = observed.mesh_port_bindings.get("http", 0)
        seen += 1
    return seen


def cpu_ms(fn: object) -> float:
    start = time.process_time()
    fn()  # type: ignore[operator]
    return (time.process_time() - start) * 1000


def build_figures(quick: bool) -> tuple[list[Row], bytes]:
    rows: list[Row] = []
    view10k: StateStore | None = None
    for envs in (1000, 5000, 10_000):
        view = local_view(envs)
        builder = RouteBuilder(view, domain=DOMAIN)

        def full(builder: RouteBuilder = builder) -> None:
            builder.rebuild_all()
            builder.content()

        ms = timed(full, 3 if quick else 7)
        target = "≤ 200 ms" if envs == 10_000 else ""
        rows.append(_row(f"full build, {envs:,} envs × 3 endpoints + VIP", ms, "ms", target, ""))
        if envs == 10_000:
            view10k = view
            reads, builds = [], []
            for _ in range(3 if quick else 9):  # alternating rounds; CPU time, which load moves less
                reads.append(cpu_ms(lambda view=view: read_inputs(view)))
                builds.append(cpu_ms(full))
            rows.append(
                _row(
                    "full build, 10,000 envs, CPU time (median of alternating rounds)",
                    statistics.median(builds),
                    "ms",
                    "",
                    f"min {min(builds):.0f}, max {max(builds):.0f}",
                )
            )
            rows.append(
                _row(
                    "the same inputs only read, nothing encoded, CPU time",
                    statistics.median(reads),
                    "ms",
                    "",
                    f"min {min(reads):.0f}, max {max(reads):.0f}: the floor under any Python encoder",
                )
            )
            ms = timed(lambda view=view: reference_content(view, DOMAIN), 3 if quick else 7)
            rows.append(
                _row(
                    "same 10,000-env snapshot built from protobuf message objects",
                    ms,
                    "ms",
                    "",
                    "the encoding before services/routes/wire.py (tests' reference)",
                )
            )
    assert view10k is not None
    builder = RouteBuilder(view10k, domain=DOMAIN)
    builder.rebuild_all()
    builder.content()
    states = [pb.INSTANCE_STATE_UNHEALTHY, pb.INSTANCE_STATE_HEALTHY]
    revision = 10**7
    samples = []
    for i in range(20 if quick else 200):
        env_index = (i * 7919) % 10_000
        aid = f"S{env_index:023d}{0:03d}"
        node_id = f"N{(env_index * REPLICAS) % NODES:025d}"
        revision += 1
        observed = pb.AssignmentObserved(state=states[i % 2], mesh_port_bindings={"http": 30000})
        view10k.apply_local(K.observed(node_id, aid), revision, observed)
        start = time.perf_counter()
        builder.apply_changes([(K.ASSIGNMENT, aid)])
        builder.content()
        samples.append((time.perf_counter() - start) * 1000)
    rows.append(
        _row("incremental rebuild, 10,000 envs, one replica's health", statistics.median(samples), "ms", "≤ 10 ms", "")
    )
    content = builder.content()
    start = time.perf_counter()
    messages = encode_messages(
        content, version=1, digest=content_digest(content), max_message_bytes=MAX_PAYLOAD - HEADER_ROOM
    )
    encode_ms = (time.perf_counter() - start) * 1000
    rows.append(_row("10,000-env snapshot, serialized", len(content) / 2**20, "MiB", "", "max_payload 8 MiB"))
    rows.append(
        _row(
            "10,000-env snapshot, zstd on the wire",
            sum(len(m.body) for m in messages) / 2**20,
            "MiB",
            "",
            f"{len(messages)} message(s)",
        )
    )
    rows.append(_row("10,000-env snapshot, digest + compress", encode_ms, "ms", "", ""))
    return rows, content


async def through_nats(content: bytes) -> list[Row]:
    """The 10,000-env snapshot published through a real nats-server and rebuilt by a RouteClient: once as
    the builders send it (zstd, one message), once uncompressed in 256 KiB chunks."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(data_dir=Path(tmp) / "nats").start()
        try:
            conn = await connect(server.url, name="bench-wire")
            await provision(conn.js)
            client = RouteClient(Path(tmp) / "routes.pb")
            updates = client.updates()
            await client.start(conn)
            try:
                for version, label, limit, compress_above in (
                    (1, "zstd, one message", MAX_PAYLOAD - HEADER_ROOM, COMPRESS_ABOVE),
                    (2, "plain, 256 KiB chunks", 256 * 1024, 1 << 40),
                ):
                    messages = encode_messages(
                        encode_snapshot(version, content),
                        version=version,
                        digest=content_digest(content),
                        max_message_bytes=limit,
                        compress_above=compress_above,
                    )
                    start = time.perf_counter()
                    for message in messages:
                        await conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
                    while (await asyncio.wait_for(updates.get(), 30)).version < version:
                        pass
                    ms = (time.perf_counter() - start) * 1000
                    assert len(client.current.http_routes) == ENVS_10K, "every route arrived"
                    rows.append(
                        _row(
                            f"10,000-env snapshot through nats-server to a RouteClient ({label})",
                            ms,
                            "ms",
                            "",
                            f"{len(messages)} message(s), decoded: {ENVS_10K:,} HTTP routes",
                        )
                    )
            finally:
                await client.stop()
                await conn.close()
        finally:
            server.stop()
    return rows


async def propagation(samples: int) -> list[Row]:
    envs = 1000
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(data_dir=Path(tmp) / "nats").start()
        try:
            conn = await connect(server.url, name="bench")
            await provision(conn.js)
            view = StateView(conn, name="bench-writer")
            await view.start()
            writer = Writer(conn, view)
            txns = [writer.txn().put(msg, key=key) for key, msg in cluster_writes(envs)]  # type: ignore[arg-type]
            probes = []
            for i in range(samples):
                env_id = f"E{(i * 37) % envs:025d}"
                probe = pb.Assignment(
                    node_id="N" + "0" * 25,
                    environment_id=env_id,
                    release_id="R" * 26,
                    desired=pb.ASSIGNMENT_DESIRED_RUN,
                )
                probe.meta.id = f"Z{i:025d}"
                txns.append(writer.txn().put(probe))
                probes.append((env_id, probe.meta.id))
            for result in await writer.commit_many(txns):
                assert result is None, result
            routes_conn = await connect(server.url, name="bench-routes")
            routes_view = StateView(routes_conn, name="bench-routes")
            await routes_view.start()
            publisher = RoutesPublisher(routes_conn, routes_view, domain=DOMAIN, clock=RealClock())
            task = asyncio.create_task(publisher.run())
            await asyncio.wait_for(publisher.ready.wait(), 30)
            client = RouteClient(Path(tmp) / "proxy" / "routes.pb")
            proxy_conn = await connect(server.url, name="bench-proxy")
            synced = client.updates()
            await client.start(proxy_conn)
            while client.version < publisher.known_version:
                await asyncio.wait_for(synced.get(), 30)
            synced.close()
            latencies = []
            for env_id, aid in probes:
                observed = pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY, mesh_port_bindings={"http": 31000})
                txn = writer.txn().put(observed, key=K.observed("N" + "0" * 25, aid))
                updates = client.updates()
                start = time.perf_counter()
                await writer.commit(txn)
                while not _has_endpoint(client, env_id, aid):
                    await asyncio.wait_for(updates.get(), 10)
                latencies.append((time.perf_counter() - start) * 1000)
                updates.close()
            task.cancel()
            await client.stop()
            for c in (proxy_conn, routes_conn, conn):
                await c.close()
        finally:
            server.stop()
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    anchor = "reference: fixed 200 ms debounce + up to the 15 s tick"
    return [
        _row(
            f"propagation p50, {envs:,} envs ({samples} writes)", statistics.median(latencies), "ms", "≤ 100 ms", anchor
        ),
        _row(f"propagation p99, {envs:,} envs ({samples} writes)", p99, "ms", "≤ 250 ms", anchor),
    ]


def _has_endpoint(client: RouteClient, env_id: str, assignment_id: str) -> bool:
    for route in client.current.http_routes:
        if route.environment_id == env_id:
            return any(e.assignment_id == assignment_id for e in route.endpoints)
    return False


def _row(figure: str, value: float, unit: str, target: str, anchor: str) -> Row:
    return {"figure": figure, "value": round(value, 2), "unit": unit, "target": target, "anchor": anchor}


def run(quick: bool = True) -> list[dict[str, object]]:
    rows, content = build_figures(quick)
    rows += asyncio.run(through_nats(content))
    rows += asyncio.run(propagation(30 if quick else 200))
    return rows


def main() -> None:
    bench_main("Routes", run, __doc__, "more repetitions")


if __name__ == "__main__":
    main()
