"""Private networking: ``python -m benchmarks.network_bench [--full]``.

A TCP echo server (its own process) stands for a database env; a client (its own process) measures, in
alternating rounds (quick 5, full 7; the order rotated each round): directly against the echo server,
through the node forwarder in user space (this process, the agent's
:class:`services.agent.forwarder.Forwarder` fed the snapshot a route client would give it) and through the
kernel path (the DNAT rule :mod:`services.agent.kernelnet` writes for a consumer address, nothing listening
behind it):

* connections/s: sequential connect, 1-byte exchange, close (quick 1,000, full 5,000 a round);
* round-trip latency of 64-byte messages on one open connection (quick 2,000, full 20,000 a round):
  p50/p99, and the added p50 (through minus direct);
* pgbench TPS (TPC-B-like, scale 1, 4 clients; quick 5 rounds of 4 s, full 7 of 20 s) against a managed
  PostgreSQL started as the add-on's script starts it (skipped without PostgreSQL and pgBackRest).

And the propagation of an endpoint change: a snapshot published on an embedded nats-server → the forwarder
routes the new endpoint / the DNAT rule points at it (quick 50 samples, full 200).

As root the bench re-runs itself in a network namespace of its own (``unshare --net``, its ``lo`` only): the
kernel path's rules never touch the machine's tables. Not root or no iptables: the kernel path is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main, embedded_server, median, percentile, row
from services.agent.forwarder import Forwarder
from services.agent.kernelnet import Dnat, KernelPath
from services.agent.kernelnet import unavailable as kernel_unavailable
from services.agent.network import consumer_address
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
    servers = [await asyncio.start_server(serve, "127.0.0.1", int(port)) for port in sys.argv[1:]]
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))

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
NETNS_FLAG = "ZATTERA_BENCH_OWN_NETNS"
MODES = ("direct", "forwarder", "kernel")
LABEL = {"direct": "direct", "forwarder": "user-space forwarder", "kernel": "kernel path (iptables DNAT)"}


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


def in_private_netns(module: str, quick: bool) -> list[dict[str, object]] | None:
    """The bench's rows measured by ``python -m module`` in a network namespace of its own (``unshare --net``,
    its ``lo`` only), so the kernel path's rules never touch the machine's tables; None when this already is
    that run, or when it cannot be made (not root, no ``unshare``/``iptables``: the kernel path is skipped)."""
    if os.environ.get(NETNS_FLAG) == "1" or kernel_unavailable() or shutil.which("unshare") is None:
        return None
    argv = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    argv += [sys.executable, "-m", module, "--json", *([] if quick else ["--full"])]
    done = subprocess.run(argv, env={**os.environ, NETNS_FLAG: "1"}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{module} in its own network namespace: {done.stderr.strip()[-1000:]}")
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


def kernel_available() -> bool:
    """The kernel path is measured only inside the bench's own namespace (see :func:`in_private_netns`)."""
    return os.environ.get(NETNS_FLAG) == "1" and not kernel_unavailable()


async def _throughput(quick: bool) -> dict[str, list[dict[str, object]]]:
    """Alternating rounds (the order rotated each round) of direct, the user-space forwarder (its consumer
    address) and the kernel path (a second consumer's address: a DNAT rule, no listener behind it)."""
    connections, trips, rounds = (1_000, 2_000, 5) if quick else (5_000, 20_000, 7)
    # One port of the same echo process per mode: connections to one endpoint port made both directly and
    # translated reuse the same 4-tuples within conntrack's TIME_WAIT, which slowed the translated ones.
    echo_ports, vip_port = {mode: free_port() for mode in MODES}, free_port()
    echo = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ECHO, *map(str, echo_ports.values()), stdout=subprocess.PIPE
    )
    forwarder = Forwarder()
    kernel = KernelPath(f"network-bench-{os.getpid()}") if kernel_available() else None
    results: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
    try:
        assert echo.stdout is not None
        await echo.stdout.readline()
        await forwarder.apply(_snapshot(1, vip_port, f"127.0.0.1:{echo_ports['forwarder']}"))
        env = await forwarder.instance_env(*_web())
        where = {
            "direct": ("127.0.0.1", echo_ports["direct"]),
            "forwarder": (env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], vip_port),
        }
        if kernel is not None:
            kernel_host = consumer_address(2, DB_VIP)  # slot 2: nothing listens there
            await asyncio.to_thread(kernel.install)
            await asyncio.to_thread(kernel.apply, [Dnat(kernel_host, vip_port, (f"127.0.0.1:{echo_ports['kernel']}",))])
            where["kernel"] = (kernel_host, vip_port)
        modes = [mode for mode in MODES if mode in where]
        for i in range(rounds):
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                results[mode].append(await _client(*where[mode], connections, trips))
        return results
    finally:
        if kernel is not None:
            await asyncio.to_thread(kernel.remove)
        await forwarder.close()
        echo.terminate()
        await echo.wait()


async def _propagation(samples: int, *, kernel: bool) -> list[float]:
    """Snapshot published → the forwarder routes the new endpoint (``kernel``: → the DNAT rule points at it)."""
    with embedded_server("zattera-network-bench-") as server:
        conn = await connect(server.url, name="network-bench")
        forwarder = Forwarder(kernel=KernelPath(f"network-bench-{os.getpid()}") if kernel else None)
        if kernel:
            await forwarder.start_kernel()
            await forwarder.instance_env(*_web())
        routes = RouteClient(server.data_dir.parent / "routes.pb", retry_max=0.5)
        await routes.start(conn)
        task = asyncio.create_task(forwarder.run(routes.updates(), lambda: ["web-env"]))
        port = free_port()
        delays = []
        try:
            for version in range(1, samples + 1):
                endpoint = f"127.0.0.1:{10_000 + version}"
                data = _snapshot(version, port, endpoint).SerializeToString(deterministic=True)
                started = time.perf_counter()
                for message in encode_messages(
                    data, version=version, digest=content_digest(data), max_message_bytes=1 << 20
                ):
                    await conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
                while forwarder.endpoints("db-env", "db") != [endpoint] or (
                    kernel and not _points_at(forwarder, endpoint)
                ):
                    await (forwarder.applied() if kernel else forwarder.changed())
                delays.append(time.perf_counter() - started)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await routes.stop()
            await forwarder.close()
            await conn.close()
    return delays


def _points_at(forwarder: Forwarder, endpoint: str) -> bool:
    installed = forwarder.kernel.installed if forwarder.kernel is not None else None
    return bool(installed) and all(rule.endpoints == (endpoint,) for rule in installed or ())


def _pgbench_rounds(quick: bool) -> dict[str, list[float]]:
    """pgbench TPS, alternating rounds of direct / forwarder / kernel path ({} without PostgreSQL)."""
    from benchmarks.addons_bench import private_network_pgbench, servers_missing

    if servers_missing():
        return {}
    return private_network_pgbench(quick, kernel=kernel_available())


def _spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    return "rounds " + ", ".join(fmt.format(v) for v in values)


def run(quick: bool = True) -> list[dict[str, object]]:
    isolated = in_private_netns("benchmarks.network_bench", quick)
    if isolated is not None:
        return isolated
    results = asyncio.run(_throughput(quick))
    samples = 50 if quick else 200
    delays = {"forwarder": asyncio.run(_propagation(samples, kernel=False))}
    if kernel_available():
        delays["kernel"] = asyncio.run(_propagation(samples, kernel=True))
    pgbench = _pgbench_rounds(quick)
    ms = 1000.0
    rows = []
    rates = {mode: [float(r["rate"]) for r in rounds] for mode, rounds in results.items() if rounds}  # type: ignore[arg-type]
    p50s = {
        mode: [percentile(r["rtts"], 50) * ms for r in rounds]  # type: ignore[arg-type]
        for mode, rounds in results.items()
        if rounds
    }
    p99s = {
        mode: [percentile(r["rtts"], 99) * ms for r in rounds]  # type: ignore[arg-type]
        for mode, rounds in results.items()
        if rounds
    }
    direct_rate, direct_p50 = median(rates["direct"]), median(p50s["direct"])
    for mode in rates:
        rows.append(
            row(
                f"network: connections/s, {LABEL[mode]} (median of {len(rates[mode])} rounds)",
                median(rates[mode]),
                f"conn/s ({_spread(rates[mode])}; {100 * median(rates[mode]) / direct_rate:.0f} % of direct)",
                target="≥ 80 % of direct" if mode == "kernel" else "",
                anchor="kube-proxy iptables mode adds no hop; userspace mode did" if mode != "direct" else "",
            )
        )
    for mode in p50s:
        rows.append(
            row(
                f"network: 64 B round trip, {LABEL[mode]}, p50",
                median(p50s[mode]),
                f"ms ({_spread(p50s[mode], '{:.3f}')}; p99 {_spread(p99s[mode], '{:.3f}')})",
            )
        )
        if mode != "direct":
            rows.append(
                row(
                    f"network: added latency per round trip, {LABEL[mode]} (p50 − direct p50)",
                    median(p50s[mode]) - direct_p50,
                    "ms",
                    target="≤ 1 ms",
                )
            )
    for mode, samples_ in delays.items():
        rows.append(
            row(
                f"network: snapshot published → {'DNAT rule re-pointed' if mode == 'kernel' else 'forwarder routes'}"
                " the new endpoint, p99",
                percentile(samples_, 99) * ms,
                f"ms (p50 {percentile(samples_, 50) * ms:.2f})",
                target="p99 ≤ 250 ms",
                anchor="same bound as the ingress proxies",
            )
        )
    if pgbench:
        direct_tps = median(pgbench["direct"])
        for mode, tps in pgbench.items():
            rows.append(
                row(
                    f"network: pgbench TPS, {LABEL[mode]} (median of {len(tps)} rounds)",
                    median(tps),
                    f"tps ({_spread(tps)}; {100 * median(tps) / direct_tps:.0f} % of direct)",
                    target="≥ 80 % of direct" if mode != "direct" else "",
                    anchor="TPC-B-like, scale 1, 4 clients",
                )
            )
    return rows


if __name__ == "__main__":
    bench_main("Private networking", run, __doc__, "5,000 connections, 20,000 round trips, 200 snapshots, 7 rounds")
