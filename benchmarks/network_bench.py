"""Private networking: ``python -m benchmarks.network_bench [--full]``.

A server (its own process: blocking sockets, a thread per listening port) stands for a database env; a
client (its own process, one per round; quick 9 rounds, full 21) reaches it in four modes: **direct** (the
server's port); the **user-space forwarder** (a consumer's address: the agent's
:class:`services.agent.forwarder.Forwarder` in this process, fed the snapshot a route client would give it);
the **kernel path** (a second ``Forwarder`` built as the agent builds it with the kernel path on: an env's
consumer address, the DNAT rule :class:`services.agent.kernelnet.KernelPath` writes for it, the forwarder's
listener behind it as the fallback); and the kernel path **crowded** (a ``KernelPath`` holding 1,000 other
pairs' rules, 100 consumers × 10 targets, the measured pair matched last). Each mode has its own server
port, so conntrack entries (TIME_WAIT: 120 s) are never shared between modes. Per round:

* connections/s: connect, 1 byte each way, close (the client closes first, as a database client does; no
  SO_LINGER tricks; the namespace's defaults: tcp_tw_reuse 2, ports 32768–60999); quick 500, full 2,000
  per mode in blocks of 50, the modes alternating block by block (order rotated each block);
* bytes/s: quick 256 MiB, full 1 GiB, down one connection and down 4 at once (order rotated each round);
* round-trip latency of 64-byte messages on one open connection (quick 1,000, full 5,000): p50/p99;
* for each block: wall time; CPU of the client (getrusage), of the server (getrusage, asked on a control
  port) and of this process's main thread (the forwarder's event loop, ``/proc/<pid>/schedstat``); the
  machine's softirq time meanwhile (``/proc/stat``, all CPUs, 10 ms ticks): CPU per connection / per GiB.

Reported: every round, medians, min/max, the ratio to direct as medians, as the median of the rounds' own
ratios, pooled over all blocks, and as CPU per unit. Plus pgbench TPS (TPC-B-like, scale 1, 4 clients;
quick 5 rounds of 4 s, full 7 of 20 s) against a managed PostgreSQL started as the add-on's script starts
it (skipped without PostgreSQL and pgBackRest), and the propagation of an endpoint change: a snapshot
published on an embedded nats-server → the forwarder routes the new endpoint / the DNAT rule points at it
(quick 50 samples, full 200). ``ZATTERA_BENCH_NETWORK_ONLY=1``: the rounds alone.

Bypassed: the agent's process (its classes are driven directly with the snapshot), the mesh (endpoints on
this machine's loopback; another node's adds masquerade and WireGuard: ``mesh_bench``).

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
from dataclasses import dataclass
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main, embedded_server, median, percentile, row
from services.agent.forwarder import Forwarder
from services.agent.kernelnet import Dnat, KernelPath, restore_text
from services.agent.kernelnet import unavailable as kernel_unavailable
from services.agent.network import consumer_address
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

spec = json.loads(sys.argv[1])
targets = {mode: (host, port) for mode, (host, port) in spec["targets"].items()}
modes, shift = list(targets), spec["round"]

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def server_cpu():
    with socket.create_connection(("127.0.0.1", spec["control"])) as s:
        s.sendall(b"C")
        return float(s.recv(64))

def bench_cpu():  # the bench's main thread (the user-space forwarder's event loop), ns
    with open(f"/proc/{spec['bench_pid']}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9

def softirq():  # the machine's, all CPUs, USER_HZ ticks
    with open("/proc/stat") as f:
        return int(f.readline().split()[7]) / spec["user_hz"]

def measured(work, *args):
    s0, b0, q0 = server_cpu(), bench_cpu(), softirq()
    c0, t0 = cpu(), time.perf_counter()
    result = work(*args)
    seconds, client = time.perf_counter() - t0, cpu() - c0
    q1, b1, s1 = softirq(), bench_cpu(), server_cpu()
    return {"seconds": seconds, "client": client, "server": s1 - s0, "bench": b1 - b0, "softirq": q1 - q0}, result

def connections(host, port, count):
    for _ in range(count):
        with socket.create_connection((host, port)) as s:
            s.sendall(b"x")
            s.recv(16)

def trips(host, port, count):
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

def stream(host, port, each, got):
    view = memoryview(bytearray(1 << 20))
    total = 0
    with socket.create_connection((host, port)) as s:
        s.sendall(b"G%d" % each)
        while n := s.recv_into(view):
            total += n
    got.append(total)

def bulk(host, port, count, streams):
    got = []
    workers = [threading.Thread(target=stream, args=(host, port, count // streams, got)) for _ in range(streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if sum(got) != count // streams * streams:
        raise SystemExit(f"bulk: {sum(got)} bytes of {count}")

out = {phase: {mode: [] for mode in modes} for phase in ("connections", "trips", "bulk", "bulk4")}
rtts = {}
block = spec["block"]
for b in range(spec["connections"] // block):  # blocks of connections, the modes alternating block by block
    k = (shift + b) % len(modes)
    for mode in modes[k:] + modes[:k]:
        out["connections"][mode].append(measured(connections, *targets[mode], block)[0])
k = shift % len(modes)
for mode in modes[k:] + modes[:k]:
    sample, rtts[mode] = measured(trips, *targets[mode], spec["trips"])
    out["trips"][mode].append(sample)
for phase, streams in (("bulk", 1), ("bulk4", spec["streams"])):
    for mode in modes[k:] + modes[:k]:
        out[phase][mode].append(measured(bulk, *targets[mode], spec["bulk"], streams)[0])
print(json.dumps({"phases": out, "rtts": rtts}))
"""


DB_VIP = "127.128.0.7"
KERNEL_VIP = "127.128.0.8"  # the kernel path's forwarder: its own consumer addresses, next to the other one's
NETNS_FLAG = "ZATTERA_BENCH_OWN_NETNS"
MODES = ("direct", "forwarder", "kernel", "kernel-crowded")
FILL_CONSUMERS, FILL_TARGETS = 100, 10
LABEL = {
    "direct": "direct",
    "forwarder": "user-space forwarder",
    "kernel": "kernel path (iptables DNAT)",
    "kernel-crowded": f"kernel path, {FILL_CONSUMERS * FILL_TARGETS:,} other pairs' rules before it",
}
PHASES = ("connections", "trips", "bulk", "bulk4")
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Params:
    rounds: int
    connections: int
    """A round's connections per mode, in blocks of :attr:`block` alternating between the modes."""
    trips: int
    bulk_bytes: int
    streams: int = 4
    block: int = 50

    def count(self, phase: str) -> int:
        return {"connections": self.block, "trips": self.trips}.get(phase, self.bulk_bytes)


QUICK = Params(rounds=9, connections=500, trips=1_000, bulk_bytes=256 * MIB)
FULL = Params(rounds=21, connections=2_000, trips=5_000, bulk_bytes=1024 * MIB)


@dataclass(frozen=True)
class Sample:
    """One block of work of one mode: wall seconds; the CPU seconds of the client, of the server and of the
    bench's main thread (the user-space forwarder's event loop); the machine's softirq seconds meanwhile (all
    CPUs, 10 ms ticks: only the sum over many blocks means something)."""

    seconds: float
    client: float
    server: float
    bench: float
    softirq: float

    @property
    def cpu(self) -> float:
        return self.client + self.server + self.bench


Results = dict[str, dict[str, list[list[Sample]]]]
"""phase → mode → its rounds → the round's blocks."""


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


async def _client(where: dict[str, tuple[str, int]], params: Params, round_: int, control: int) -> dict[str, object]:
    spec = {
        "targets": where,
        "round": round_,
        "control": control,
        "bench_pid": os.getpid(),
        "user_hz": os.sysconf("SC_CLK_TCK"),
        "connections": params.connections,
        "block": params.block,
        "trips": params.trips,
        "bulk": params.bulk_bytes,
        "streams": params.streams,
    }
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, json.dumps(spec), stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"network bench client (round {round_}) exited with {proc.returncode}")
    got: dict[str, object] = json.loads(out)
    return got


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


async def _throughput(params: Params) -> tuple[Results, dict[str, list[list[float]]], dict[str, str]]:
    """Rounds (a client process each) of every phase, the modes alternating within each (connections: block by
    block; the others: once a round, the order rotated each round). Returns the blocks, the round trips (mode
    → rounds → seconds) and facts of the run (conntrack, sysctls) for the report. The modes: direct to
    the server's port; the user-space forwarder (a consumer's address; :class:`Forwarder` in this process, as
    in the agent); the kernel path (a second forwarder built as the agent builds it with the kernel path on:
    the same kind of consumer address, its DNAT rule written by :class:`KernelPath`, the forwarder's listener
    behind it as the fallback)."""
    # One server port per mode: a translated connection's conntrack entry (reply tuple: server port ↔ the
    # client's port) must not meet a direct one's still in TIME_WAIT (120 s), which stalls or re-tracks it.
    ports, control = {mode: free_port() for mode in MODES}, free_port()
    vip_ports = {"forwarder": free_port(), "kernel": free_port()}
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, *map(str, [*ports.values(), control]), stdout=subprocess.PIPE
    )
    forwarder = Forwarder()
    kernel = Forwarder(kernel=KernelPath(f"network-bench-{os.getpid()}")) if kernel_available() else None
    crowded = KernelPath(f"network-bench-crowded-{os.getpid()}") if kernel is not None else None
    results: Results = {phase: {mode: [] for mode in MODES} for phase in PHASES}
    rtts: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    try:
        assert server.stdout is not None
        await server.stdout.readline()
        await forwarder.apply(_snapshot(1, vip_ports["forwarder"], f"127.0.0.1:{ports['forwarder']}"))
        env = await forwarder.instance_env(*_web())
        where = {
            "direct": ("127.0.0.1", ports["direct"]),
            "forwarder": (env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], vip_ports["forwarder"]),
        }
        if crowded is not None:  # installed first: the forwarder's jump goes before it, as a second agent's would
            crowded_host = consumer_address(127, KERNEL_VIP)
            fill = [
                Dnat(consumer_address(c, f"127.128.0.{20 + t}"), 5432, ("127.0.0.1:9",))
                for c in range(1, FILL_CONSUMERS + 1)
                for t in range(1, FILL_TARGETS + 1)
            ]
            rules = sorted([*fill, Dnat(crowded_host, vip_ports["kernel"], (f"127.0.0.1:{ports['kernel-crowded']}",))])
            assert rules[-1].address == crowded_host  # the last pair a new connection is matched against
            await asyncio.to_thread(crowded.install)
            await asyncio.to_thread(crowded.apply, rules)
            where["kernel-crowded"] = (crowded_host, vip_ports["kernel"])
        if kernel is not None:
            path = await kernel.start_kernel()
            if not path.startswith("kernel"):
                raise RuntimeError(f"network bench: no kernel path in the bench's namespace: {path}")
            await kernel.apply(_snapshot(1, vip_ports["kernel"], f"127.0.0.1:{ports['kernel']}", vip=KERNEL_VIP))
            env = await kernel.instance_env(*_web())
            where["kernel"] = (env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], vip_ports["kernel"])
            assert kernel.kernel is not None and kernel.kernel.installed, "the consumer's DNAT rule is not written"
        for i in range(params.rounds):
            got = await _client(where, params, i, control)
            for phase, by_mode in got["phases"].items():  # type: ignore[attr-defined]
                for mode, blocks in by_mode.items():
                    results[phase][mode].append([Sample(**block) for block in blocks])
            for mode, trips in got["rtts"].items():  # type: ignore[attr-defined]
                rtts[mode].append(trips)
        return results, rtts, _facts(kernel)
    finally:
        if kernel is not None:
            await kernel.close()
        if crowded is not None:
            await asyncio.to_thread(crowded.remove)
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


def _rate_rows(results: Results, params: Params) -> list[dict[str, object]]:
    rows = []
    for phase, what, unit, scale in (
        ("connections", "connections/s (connect, 1 byte each way, close)", "conn/s", 1.0),
        ("bulk", f"bytes/s, {params.bulk_bytes // MIB} MiB down one connection", "MiB/s", 1 / MIB),
        (
            "bulk4",
            f"bytes/s, {params.bulk_bytes // MIB} MiB down {params.streams} connections at once",
            "MiB/s",
            1 / MIB,
        ),
    ):
        count = params.count(phase)
        done = {mode: rounds for mode, rounds in results[phase].items() if rounds}
        rates = {
            mode: [count * len(blocks) * scale / sum(b.seconds for b in blocks) for blocks in rounds]
            for mode, rounds in done.items()
        }
        pooled = {
            mode: count * sum(map(len, rounds)) * scale / sum(b.seconds for blocks in rounds for b in blocks)
            for mode, rounds in done.items()
        }
        per_unit = "µs per connection" if phase == "connections" else "s per GiB"
        cpu: dict[str, float] = {}
        for mode, rounds in done.items():
            blocks = [b for blocks in rounds for b in blocks]
            unit_scale = 1e6 if phase == "connections" else GIB
            per = unit_scale / (count * len(blocks))
            client, server = sum(b.client for b in blocks) * per, sum(b.server for b in blocks) * per
            bench, softirq = sum(b.bench for b in blocks) * per, sum(b.softirq for b in blocks) * per
            cpu[mode] = client + server + bench
            by_round = [sum(b.cpu for b in blocks) * unit_scale / (count * len(blocks)) for blocks in rounds]
            fmt = "{:.1f}" if phase == "connections" else "{:.2f}"
            versus = ""
            if mode != "direct":
                paired = median([m / d for m, d in zip(rates[mode], rates["direct"], strict=True)])
                versus = (
                    f"; of direct: {100 * median(rates[mode]) / median(rates['direct']):.0f} % (medians),"
                    f" {100 * paired:.0f} % (median of the rounds' ratios),"
                    f" {100 * pooled[mode] / pooled['direct']:.0f} % (all blocks pooled),"
                    f" {100 * cpu['direct'] / cpu[mode]:.0f} % (CPU per unit, direct ÷ this)"
                )
            rows.append(
                row(
                    f"network: {what}, {LABEL[mode]} (median of {len(rounds)} rounds)",
                    median(rates[mode]),
                    f"{unit} ({_spread(rates[mode])}; pooled {pooled[mode]:,.0f}{versus}."
                    f" CPU {cpu[mode]:,.2f} {per_unit}: client {client:,.2f}, server {server:,.2f},"
                    f" bench main thread {bench:,.2f}; machine's softirq meanwhile {softirq:,.2f};"
                    f" CPU by round {_spread(by_round, fmt)})",
                    target="≥ 80 % of direct" if mode == "kernel" else "",
                    anchor="kube-proxy iptables mode adds no hop; userspace mode did" if mode != "direct" else "",
                )
            )
    return rows


def _trip_rows(rtts: dict[str, list[list[float]]]) -> list[dict[str, object]]:
    ms = 1000.0
    done = {mode: rounds for mode, rounds in rtts.items() if rounds}
    p50s = {mode: [percentile(r, 50) * ms for r in rounds] for mode, rounds in done.items()}
    p99s = {mode: [percentile(r, 99) * ms for r in rounds] for mode, rounds in done.items()}
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
    results, rtts, facts = asyncio.run(_throughput(params))
    load1 = os.getloadavg()[0]
    rows = _rate_rows(results, params) + _trip_rows(rtts)
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
