"""The encrypted mesh between machines against the plain path, in one run (issue 34): two machines, each a
network namespace on a bridge (``tests/multinode/harness.py``: veth links and addresses only inside), and in
each the agent's own mesh code (``services/agent/mesh.py``: ``ensure_interface`` makes ``zattera0`` —
kernel WireGuard where the kernel has it, else ``wireguard-go`` — and ``sync`` gives it the other machine as
its peer, as the agent does from the node records). Then from machine a to machine b, alternating rounds of:

* throughput: one TCP connection sending for a fixed time to a sink on b (1 MiB writes), MiB/s;
* latency: 1-byte request and answer on one connection, round trip p50 / p99;
* new connections: connect, 1-byte exchange, close, per second;

to b's mesh address (inside WireGuard) and to b's veth address (the plain path). Target (issue 34): mesh
throughput ≥ 50 % of the plain path for userspace WireGuard. What it bypasses: the agent's process around the
mesh code (key exchange through node records, the forwarder's and proxies' hops, measured elsewhere).

``python -m benchmarks.mesh_bench [--full]``: quick, 3 rounds of 2 s per figure; full, 7 rounds of 5 s. Needs
root, ``ip netns``, ``wg`` (wireguard-tools) and kernel WireGuard or ``wireguard-go``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Row, bench_main, percentile, row
from services.agent.mesh import available, load_or_create_key
from tests.multinode.harness import Machine, Network, unavailable

MESH = {"a": "10.98.0.1", "b": "10.98.0.2"}
SINK_PORT, ECHO_PORT = 7101, 7102

MACHINE = r"""
import socket, sys, threading
from pathlib import Path
from services.agent.mesh import PORT, Peer, ensure_interface, sync
me, key, peer_key, peer_mesh, peer_addr, conf = sys.argv[1:7]
kind = ensure_interface(me)
sync(Path(conf), key, [Peer(peer_key, peer_mesh, f"{peer_addr}:{PORT}")])

def sink(conn):
    with conn:
        while conn.recv(1 << 20):
            pass

def echo(conn):
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(16):
            conn.sendall(data)

def serve(port, handle):
    server = socket.create_server(("0.0.0.0", port), backlog=512)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()

for port, handle in ((int(sys.argv[7]), sink), (int(sys.argv[8]), echo)):
    threading.Thread(target=serve, args=(port, handle), daemon=True).start()
print("ready", kind, flush=True)
threading.Event().wait()
"""

CLIENT = r"""
import json, socket, sys, time
host, what, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
sink, echo = int(sys.argv[4]), int(sys.argv[5])
out = {}
deadline = time.monotonic() + seconds
if what == "throughput":
    chunk = b"x" * (1 << 20)
    with socket.create_connection((host, sink), timeout=10) as c:
        sent, start = 0, time.monotonic()
        while time.monotonic() < deadline:
            c.sendall(chunk)
            sent += len(chunk)
        c.shutdown(socket.SHUT_WR)
        c.recv(1)
        out["mib_s"] = sent / (1 << 20) / (time.monotonic() - start)
elif what == "latency":
    with socket.create_connection((host, echo), timeout=10) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        while time.monotonic() < deadline:
            t = time.perf_counter()
            c.sendall(b"x")
            c.recv(1)
            rtts.append((time.perf_counter() - t) * 1000)
        out["rtts"] = rtts
else:
    done, start = 0, time.monotonic()
    while time.monotonic() < deadline:
        with socket.create_connection((host, echo), timeout=10) as c:
            c.sendall(b"x")
            c.recv(1)
        done += 1
    out["conn_s"] = done / (time.monotonic() - start)
print(json.dumps(out))
"""


def start_machine(
    machine: Machine, peer: Machine, keys: dict[str, tuple[str, str]]
) -> tuple[subprocess.Popen[str], str]:
    """The mesh up in ``machine`` with ``peer`` as its peer, and the sink and echo servers; waits until ready."""
    run_wireguard = machine.data_dir / "run-wireguard"  # wireguard-go's control socket: the machine's own /run
    run_wireguard.mkdir(parents=True, exist_ok=True)
    own_run = 'mkdir -p /run/wireguard && mount --bind "$0" /run/wireguard && exec "$@"'
    argv = [
        "ip", "netns", "exec", machine.netns,
        "unshare", "--mount", "--propagation", "private", "sh", "-c", own_run, str(run_wireguard),
        sys.executable, "-c", MACHINE,
        MESH[machine.name], keys[machine.name][0], keys[peer.name][1], MESH[peer.name], peer.address,
        str(machine.data_dir / "zattera0.conf"), str(SINK_PORT), str(ECHO_PORT),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path.cwd())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"[{machine.name}] mesh did not come up: {line} {proc.stderr.read() if proc.stderr else ''}")
    return proc, line.split()[-1]


def client(machine: Machine, host: str, what: str, seconds: float) -> dict[str, object]:
    done = machine.exec(
        sys.executable, "-c", CLIENT, host, what, str(seconds), str(SINK_PORT), str(ECHO_PORT), timeout=seconds + 60
    )
    return dict(json.loads(done.stdout))


def run(quick: bool = True) -> list[Row]:
    why = unavailable() or available()
    if why:
        raise RuntimeError(f"mesh_bench needs machines in namespaces and WireGuard: {why}")
    rounds, seconds = (3, 2.0) if quick else (7, 5.0)
    with tempfile.TemporaryDirectory(prefix="zattera-mesh-bench-") as tmp:
        network = Network(Path(tmp))
        procs: list[subprocess.Popen[str]] = []
        try:
            a, b = network.add("a"), network.add("b")
            keys = {m.name: load_or_create_key(Path(tmp) / f"{m.name}.key") for m in (a, b)}
            started = [start_machine(a, b, keys), start_machine(b, a, keys)]
            procs = [proc for proc, _ in started]
            kind = started[0][1]
            paths = {"mesh": MESH["b"], "plain": b.address}
            deadline = time.monotonic() + 30
            while True:  # the first handshake
                try:
                    client(a, paths["mesh"], "connections", 0.2)
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
            figures: dict[tuple[str, str], list[float]] = {}
            rtts: dict[str, list[float]] = {"mesh": [], "plain": []}
            for i in range(rounds):
                order = ("mesh", "plain") if i % 2 == 0 else ("plain", "mesh")
                for what in ("throughput", "latency", "connections"):
                    for path in order:
                        got = client(a, paths[path], what, seconds)
                        if what == "latency":
                            samples = [float(x) for x in got["rtts"]]  # type: ignore[attr-defined]
                            rtts[path] += samples
                            figures.setdefault((what, path), []).append(statistics.median(samples))
                        else:
                            figures.setdefault((what, path), []).append(
                                float(got["mib_s" if what == "throughput" else "conn_s"])
                            )  # type: ignore[arg-type]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(10)
            network.close()
    rows: list[Row] = []

    def spread(values: list[float]) -> str:
        return " / ".join(f"{v:,.1f}" for v in values)

    for what, unit in (("throughput", "MiB/s"), ("connections", "connections/s")):
        mesh, plain = figures[(what, "mesh")], figures[(what, "plain")]
        rows.append(
            row(
                f"{what}, plain veth path (median of {rounds} rounds)",
                statistics.median(plain),
                unit,
                "",
                spread(plain),
            )
        )
        rows.append(row(f"{what}, over the mesh (WireGuard: {kind})", statistics.median(mesh), unit, "", spread(mesh)))
        share = 100 * statistics.median(mesh) / statistics.median(plain)
        rows.append(row(f"{what}, mesh share of the plain path", share, "%", "≥ 50 %" if what == "throughput" else ""))
    for path in ("plain", "mesh"):
        rows.append(row(f"round trip p50, {path}", percentile(rtts[path], 50), "ms"))
        rows.append(row(f"round trip p99, {path}", percentile(rtts[path], 99), "ms"))
    added = percentile(rtts["mesh"], 50) - percentile(rtts["plain"], 50)
    rows.append(row("round trip added by the mesh, p50", added, "ms"))
    return rows


if __name__ == "__main__":
    bench_main("The mesh between machines against the plain path", run, __doc__, "7 rounds of 5 s")
