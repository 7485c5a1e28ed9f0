"""Private networking: ``python -m benchmarks.network_bench [--full]``.

A TCP echo server (its own process) stands for a database env; a client (its own process) measures, in
one run, directly against the echo server and then through the node forwarder (this process, the
agent's :class:`services.agent.forwarder.Forwarder` fed the snapshot a route client would give it):

* connections/s: sequential connect, 1-byte exchange, close (quick 500, full 5,000);
* round-trip latency of 64-byte messages on one open connection (quick 2,000, full 20,000): p50/p99,
  and the forwarder's added p50 (through minus direct).

A third figure is the propagation of an endpoint change: a snapshot published on an embedded
nats-server → the forwarder routes the new endpoint (quick 50 samples, full 200).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main, embedded_server, percentile, row
from services.agent.forwarder import Forwarder
from shared.connection import connect
from shared.embedded import free_port
from shared.routeclient import RouteClient
from shared.routewire import content_digest, encode_messages
from shared.subjects import ROUTES_SNAPSHOT_SUBJECT

ECHO = """
import asyncio, sys

async def serve(reader, writer):
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""

CLIENT = """
import json, socket, sys, time

host, port, connections, trips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
started = time.perf_counter()
for _ in range(connections):
    with socket.create_connection((host, port)) as s:
        s.sendall(b"x")
        s.recv(16)
rate = connections / (time.perf_counter() - started)
rtts = []
with socket.create_connection((host, port)) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"y" * 64
    for _ in range(trips):
        t0 = time.perf_counter()
        s.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(s.recv(4096))
        rtts.append(time.perf_counter() - t0)
print(json.dumps({"rate": rate, "rtts": rtts}))
"""

DB_VIP = "127.128.0.7"


def _snapshot(version: int, port: int, *addrs: str) -> cpb.RouteSnapshot:
    service = cpb.InternalService(
        fqdn="db.production.shop.internal.", project_id="shop-id", environment_id="db-env", vip=DB_VIP
    )
    service.ports.add(
        name="db", port=port, protocol="tcp", endpoints=[cpb.Endpoint(addr=a, healthy=True) for a in addrs]
    )
    return cpb.RouteSnapshot(version=version, internal_services=[service])


def _web() -> tuple[pb.Assignment, pb.Release]:
    return (
        pb.Assignment(environment_id="web-env", project_id="shop-id"),
        pb.Release(environment_id="web-env", project_id="shop-id"),
    )


async def _client(host: str, port: int, connections: int, trips: int) -> dict[str, object]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, host, str(port), str(connections), str(trips), stdout=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    result: dict[str, object] = json.loads(out)
    return result


async def _throughput(quick: bool) -> list[dict[str, object]]:
    connections, trips = (500, 2_000) if quick else (5_000, 20_000)
    echo_port, vip_port = free_port(), free_port()
    echo = await asyncio.create_subprocess_exec(sys.executable, "-c", ECHO, str(echo_port), stdout=subprocess.PIPE)
    forwarder = Forwarder()
    try:
        assert echo.stdout is not None
        await echo.stdout.readline()
        await forwarder.apply(_snapshot(1, vip_port, f"127.0.0.1:{echo_port}"))
        env = await forwarder.instance_env(*_web())
        direct = await _client("127.0.0.1", echo_port, connections, trips)
        through = await _client(env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], vip_port, connections, trips)
        return [direct, through]
    finally:
        await forwarder.close()
        echo.terminate()
        await echo.wait()


async def _propagation(samples: int) -> list[float]:
    with embedded_server("zattera-network-bench-") as server:
        conn = await connect(server.url, name="network-bench")
        forwarder = Forwarder()
        routes = RouteClient(server.data_dir.parent / "routes.pb", retry_max=0.5)
        await routes.start(conn)
        task = asyncio.create_task(forwarder.run(routes.updates(), lambda: ["web-env"]))
        port = free_port()
        delays = []
        try:
            for version in range(1, samples + 1):
                data = _snapshot(version, port, f"127.0.0.1:{10_000 + version}").SerializeToString(deterministic=True)
                started = time.perf_counter()
                for message in encode_messages(
                    data, version=version, digest=content_digest(data), max_message_bytes=1 << 20
                ):
                    await conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
                while forwarder.endpoints("db-env", "db") != [f"127.0.0.1:{10_000 + version}"]:
                    await forwarder.changed()
                delays.append(time.perf_counter() - started)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await routes.stop()
            await forwarder.close()
            await conn.close()
    return delays


def run(quick: bool = True) -> list[dict[str, object]]:
    direct, through = asyncio.run(_throughput(quick))
    delays = asyncio.run(_propagation(50 if quick else 200))
    d_rtt, t_rtt = direct["rtts"], through["rtts"]
    assert isinstance(d_rtt, list) and isinstance(t_rtt, list)
    ms = 1000.0
    return [
        row(
            "network: connections/s, direct → through the forwarder",
            float(through["rate"]),  # type: ignore[arg-type]
            f"conn/s (direct {float(direct['rate']):,.0f})",  # type: ignore[arg-type]
            anchor="kube-proxy iptables mode adds no hop; userspace mode did (this design)",
        ),
        row(
            "network: 64 B round trip through the forwarder, p50",
            percentile(t_rtt, 50) * ms,
            f"ms (p99 {percentile(t_rtt, 99) * ms:.3f}; direct p50 {percentile(d_rtt, 50) * ms:.3f}, "
            f"p99 {percentile(d_rtt, 99) * ms:.3f})",
        ),
        row(
            "network: added latency per round trip (p50 through − direct)",
            (percentile(t_rtt, 50) - percentile(d_rtt, 50)) * ms,
            "ms",
            target="≤ 1 ms",
        ),
        row(
            "network: snapshot published → forwarder routes the new endpoint, p99",
            percentile(delays, 99) * ms,
            f"ms (p50 {percentile(delays, 50) * ms:.2f})",
            target="p99 ≤ 250 ms",
            anchor="same bound as the ingress proxies",
        ),
    ]


if __name__ == "__main__":
    bench_main("Private networking", run, __doc__, "5,000 connections, 20,000 round trips, 200 snapshots")
