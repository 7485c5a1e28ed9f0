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
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main, embedded_server, median, percentile, row
from services.agent.forwarder import Forwarder
from services.agent.kernelnet import KernelPath, restore_text
from services.agent.kernelnet import unavailable as kernel_unavailable
from shared.connection import connect
from shared.embedded import free_port
from shared.routeclient import RouteClient
from shared.routewire import content_digest, encode_messages
from shared.subjects import ROUTES_SNAPSHOT_SUBJECT

SERVER = r"""
import resource, socket, sys, threading

CHUNK = memoryview(bytes(1 << 20))

def rusage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return f"{r.ru_utime + r.ru_stime:.6f}".encode()

def echo(conn, first):
    with conn:
        data = first
        while data:
            conn.sendall(data)
            data = conn.recv(65536)

def bulk(conn, count):
    with conn:
        while count > 0:
            conn.sendall(CHUNK[: min(count, len(CHUNK))])
            count -= len(CHUNK)

def serve(listener):
    while True:
        conn, _ = listener.accept()
        first = conn.recv(65536)
        if first == b"x":  # one connection of the connections/s figure: answered inline, waits for the close
            conn.sendall(first)
            conn.recv(16)
            conn.close()
        elif first.startswith(b"G"):  # a bulk stream: that many bytes, then close
            threading.Thread(target=bulk, args=(conn, int(first[1:])), daemon=True).start()
        elif first == b"C":  # the server's own CPU seconds so far (the bench's control port)
            conn.sendall(rusage())
            conn.close()
        else:
            threading.Thread(target=echo, args=(conn, first), daemon=True).start()

threads = []
for port in sys.argv[1:]:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(port)))
    listener.listen(1024)
    threads.append(threading.Thread(target=serve, args=(listener,), daemon=True))
for thread in threads:
    thread.start()
print("ready", flush=True)
threading.Event().wait()
"""

CLIENT = r"""
import json, resource, socket, sys, threading, time

host, port, phase, count, streams = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def connections():
    for _ in range(count):
        with socket.create_connection((host, port)) as s:
            s.sendall(b"x")
            s.recv(16)

def trips():
    rtts = []
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = b"y" * 64
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(s.recv(4096))
            rtts.append(time.perf_counter() - t0)
    return rtts

def stream(each, got):
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    total = 0
    with socket.create_connection((host, port)) as s:
        s.sendall(b"G%d" % each)
        while n := s.recv_into(view):
            total += n
    got.append(total)

def bulk():
    got = []
    workers = [threading.Thread(target=stream, args=(count // streams, got)) for _ in range(streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if sum(got) != count // streams * streams:
        raise SystemExit(f"bulk: {sum(got)} bytes of {count}")

cpu0, t0 = cpu(), time.perf_counter()
rtts = trips() if phase == "trips" else (connections() if phase == "connections" else bulk())
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": cpu() - cpu0, "rtts": rtts or []}))
"""

DB_VIP = "127.128.0.7"
KERNEL_VIP = "127.128.0.8"  # the kernel path's forwarder: its own consumer addresses, next to the other one's
NETNS_FLAG = "ZATTERA_BENCH_OWN_NETNS"
MODES = ("direct", "forwarder", "kernel")
LABEL = {"direct": "direct", "forwarder": "user-space forwarder", "kernel": "kernel path (iptables DNAT)"}
PHASES = ("connections", "trips", "bulk", "bulk4")
GIB = 1 << 30
MIB = 1 << 20
USER_HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Params:
    rounds: int
    connections: int
    trips: int
    bulk_bytes: int
    streams: int = 4

    def count(self, phase: str) -> int:
        return {"connections": self.connections, "trips": self.trips}.get(phase, self.bulk_bytes)


QUICK = Params(rounds=9, connections=500, trips=1_000, bulk_bytes=256 * MIB)
FULL = Params(rounds=21, connections=2_000, trips=5_000, bulk_bytes=1024 * MIB)


@dataclass
class Sample:
    """One client run: wall seconds and the CPU seconds of the client, the server and the bench's process (the
    user-space forwarder lives there), and the machine's softirq seconds meanwhile (all CPUs)."""

    seconds: float
    client: float
    server: float
    bench: float
    softirq: float
    rtts: list[float]

    @property
    def cpu(self) -> float:
        return self.client + self.server + self.bench


def _snapshot(version: int, port: int, *addrs: str, vip: str = DB_VIP) -> cpb.RouteSnapshot:
    service = cpb.InternalService(
        fqdn="db.production.shop.internal.", project_id="shop-id", environment_id="db-env", vip=vip
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


def _softirq() -> float:
    """The machine's softirq seconds so far, all CPUs (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        return int(stat.readline().split()[7]) / USER_HZ


def _server_cpu(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"C")
        return float(s.recv(64))


async def _client(host: str, port: int, phase: str, params: Params, control: int) -> Sample:
    streams = params.streams if phase == "bulk4" else 1
    argv = [sys.executable, "-c", CLIENT, host, str(port), phase.rstrip("4"), str(params.count(phase)), str(streams)]
    server0, bench0, softirq0 = _server_cpu(control), time.process_time(), _softirq()
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"network bench client ({phase} to {host}:{port}) exited with {proc.returncode}")
    bench, softirq, server = time.process_time() - bench0, _softirq() - softirq0, _server_cpu(control) - server0
    got = json.loads(out)
    return Sample(got["seconds"], got["cpu"], server, bench, softirq, got["rtts"])


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


Results = dict[str, dict[str, list[Sample]]]
"""phase → mode → its rounds."""


async def _throughput(params: Params) -> tuple[Results, dict[str, str]]:
    """Rounds of every phase, the modes alternating within each (their order rotated each round): direct to
    the server's port; the user-space forwarder (a consumer's address; :class:`Forwarder` in this process, as
    in the agent); the kernel path (a second forwarder built as the agent builds it with the kernel path on:
    the same kind of consumer address, its DNAT rule written by :class:`KernelPath`, the forwarder's listener
    behind it as the fallback). Also returns facts of the run (conntrack, sysctls) for the report."""
    # One server port per mode: a translated connection's conntrack entry (reply tuple: server port ↔ the
    # client's port) must not meet a direct one's still in TIME_WAIT (120 s), which stalls or re-tracks it.
    ports, control = {mode: free_port() for mode in MODES}, free_port()
    vip_ports = {"forwarder": free_port(), "kernel": free_port()}
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, *map(str, [*ports.values(), control]), stdout=subprocess.PIPE
    )
    forwarder = Forwarder()
    kernel = Forwarder(kernel=KernelPath(f"network-bench-{os.getpid()}")) if kernel_available() else None
    results: Results = {phase: {mode: [] for mode in MODES} for phase in PHASES}
    try:
        assert server.stdout is not None
        await server.stdout.readline()
        await forwarder.apply(_snapshot(1, vip_ports["forwarder"], f"127.0.0.1:{ports['forwarder']}"))
        env = await forwarder.instance_env(*_web())
        where = {
            "direct": ("127.0.0.1", ports["direct"]),
            "forwarder": (env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], vip_ports["forwarder"]),
        }
        if kernel is not None:
            path = await kernel.start_kernel()
            if not path.startswith("kernel"):
                raise RuntimeError(f"network bench: no kernel path in the bench's namespace: {path}")
            await kernel.apply(_snapshot(1, vip_ports["kernel"], f"127.0.0.1:{ports['kernel']}", vip=KERNEL_VIP))
            env = await kernel.instance_env(*_web())
            where["kernel"] = (env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], vip_ports["kernel"])
            assert kernel.kernel is not None and kernel.kernel.installed, "the consumer's DNAT rule is not written"
        modes = [mode for mode in MODES if mode in where]
        for i in range(params.rounds):
            for phase in PHASES:
                for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                    results[phase][mode].append(await _client(*where[mode], phase, params, control))
        return results, _facts(kernel)
    finally:
        if kernel is not None:
            await kernel.close()
        await forwarder.close()
        server.terminate()
        await server.wait()


def _facts(kernel: Forwarder | None) -> dict[str, str]:
    def read(path: str) -> str:
        try:
            return " ".join(Path(path).read_text().split())
        except OSError:
            return "?"

    facts = {
        name: read(f"/proc/sys/net/{path}")
        for name, path in (
            ("conntrack entries at the end", "netfilter/nf_conntrack_count"),
            ("conntrack max", "netfilter/nf_conntrack_max"),
            ("conntrack buckets", "netfilter/nf_conntrack_buckets"),
            ("tcp_tw_reuse", "ipv4/tcp_tw_reuse"),
            ("ephemeral ports", "ipv4/ip_local_port_range"),
        )
    }
    if kernel is not None and kernel.kernel is not None:
        facts["rules"] = "; ".join(
            line
            for line in restore_text(kernel.kernel.names, kernel.kernel.installed or []).splitlines()
            if "-A " in line
        )
    return facts


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


def _paired(rates: dict[str, list[float]], mode: str) -> float:
    """Median of the per-round ratios to direct (the two measured seconds apart in the same round)."""
    return 100 * median([m / d for m, d in zip(rates[mode], rates["direct"], strict=True) if d > 0])


def _rate_rows(results: Results, params: Params) -> list[dict[str, object]]:
    rows = []
    for phase, what, unit, scale, fmt in (
        ("connections", "connections/s (connect, 1 byte each way, close)", "conn/s", 1.0, "{:,.0f}"),
        ("bulk", f"bytes/s, {params.bulk_bytes // MIB} MiB down one connection", "MiB/s", 1 / MIB, "{:,.0f}"),
        (
            "bulk4",
            f"bytes/s, {params.bulk_bytes // MIB} MiB down {params.streams} connections at once",
            "MiB/s",
            1 / MIB,
            "{:,.0f}",
        ),
    ):
        count = params.count(phase)
        done = {mode: samples for mode, samples in results[phase].items() if samples}
        rates = {mode: [count * scale / s.seconds for s in samples] for mode, samples in done.items()}
        for mode, samples in done.items():
            total = len(samples) * count
            per, per_unit = (1e6 / total, "µs per connection") if phase == "connections" else (GIB / total, "s per GiB")
            client, server = sum(s.client for s in samples) * per, sum(s.server for s in samples) * per
            bench, softirq = sum(s.bench for s in samples) * per, sum(s.softirq for s in samples) * per
            cpu = (
                f"CPU {client + server + bench:,.1f} {per_unit}: client {client:,.1f}, server {server:,.1f},"
                f" bench process {bench:,.1f}; machine's softirq {softirq:,.1f}"
            )
            versus = (
                ""
                if mode == "direct"
                else (
                    f"; {100 * median(rates[mode]) / median(rates['direct']):.0f} % of direct,"
                    f" paired rounds {_paired(rates, mode):.0f} %"
                )
            )
            rows.append(
                row(
                    f"network: {what}, {LABEL[mode]} (median of {len(samples)} rounds)",
                    median(rates[mode]),
                    f"{unit} ({_spread(rates[mode], fmt)}; min {min(rates[mode]):,.0f}, max {max(rates[mode]):,.0f}"
                    f"{versus}; {cpu})",
                    target="≥ 80 % of direct" if mode == "kernel" else "",
                    anchor="kube-proxy iptables mode adds no hop; userspace mode did" if mode != "direct" else "",
                )
            )
    return rows


def _trip_rows(results: Results) -> list[dict[str, object]]:
    ms = 1000.0
    done = {mode: samples for mode, samples in results["trips"].items() if samples}
    p50s = {mode: [percentile(s.rtts, 50) * ms for s in samples] for mode, samples in done.items()}
    p99s = {mode: [percentile(s.rtts, 99) * ms for s in samples] for mode, samples in done.items()}
    rows = []
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
                    median(p50s[mode]) - median(p50s["direct"]),
                    "ms",
                    target="≤ 1 ms",
                )
            )
    return rows


def run(quick: bool = True) -> list[dict[str, object]]:
    isolated = in_private_netns("benchmarks.network_bench", quick)
    if isolated is not None:
        return isolated
    params = QUICK if quick else FULL
    load0, started = os.getloadavg()[0], time.time()
    results, facts = asyncio.run(_throughput(params))
    load1 = os.getloadavg()[0]
    rows = _rate_rows(results, params) + _trip_rows(results)
    rows.append(
        row(
            "network: the run's circumstances",
            load1,
            "load average at the end of the rounds"
            f" (at the start {load0:.1f}; rounds started {time.strftime('%H:%M:%S', time.gmtime(started))} UTC;"
            + "; ".join(f"{k}: {v}" for k, v in facts.items())
            + ")",
        )
    )
    if os.environ.get("ZATTERA_BENCH_NETWORK_ONLY") == "1":
        return rows  # the throughput rounds alone (a quicker look; not in the published figures)
    samples = 50 if quick else 200
    delays = {"forwarder": asyncio.run(_propagation(samples, kernel=False))}
    if kernel_available():
        delays["kernel"] = asyncio.run(_propagation(samples, kernel=True))
    ms = 1000.0
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
    pgbench = _pgbench_rounds(quick)
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
    bench_main(
        "Private networking",
        run,
        __doc__,
        "21 rounds: 2,000 connections, 5,000 round trips, 1 GiB down 1 and 4 connections; 200 snapshots",
    )
