"""Ingress data path side by side (issue 18): requests/s and p50 latency with wrk (1 thread, 32 connections)
against one nginx backend answering a fixed 200, at 1 and 10,000 envs:

* the backend directly;
* HAProxy hand-configured (1 thread, ``use_backend`` through an N-host map, keep-alive to one server);
* nginx (1 worker, ``map $host``, keep-alive upstream);
* the Python proxy (``--engine python``, the fallback; 1 env);
* our ingress: HAProxy driven by :class:`services.proxy.haproxy_engine.HAProxyEngine` (N envs, N backends);

then, on our ingress at N envs: route change applied (``apply`` called → the new endpoint served) p99 over
repeated endpoint moves, and failed requests under wrk load during those changes.

``python -m benchmarks.ingress_bench [--full]``. wrk, nginx and haproxy are Debian packages installed with
``deploy/system-packages.sh`` when missing (root), else the bench says what to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb

from benchmarks.common import Row, bench_main, median, percentile, row
from services.proxy.haproxy_certs import self_signed_pem
from services.proxy.haproxy_config import Layout
from services.proxy.haproxy_engine import HAProxyEngine
from services.proxy.settings import ROUTES_CACHE_FILE
from shared.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wrk", "nginx", "haproxy", "nghttp2-client")  # nghttp2-client: h2load


def install() -> None:
    subprocess.run([str(ROOT / "deploy" / "system-packages.sh"), *PACKAGES], check=True)


def wrk(port: int, host: str, seconds: float, scheme: str = "http", close: bool = False) -> tuple[float, float, int]:
    """(requests/s, p50 ms, failed requests) of one wrk run; ``close``: a new connection per request."""
    extra = ["-H", "Connection: close"] if close else []
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            "-c32",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-H",
            f"Host: {host}",
            *extra,
            f"{scheme}://127.0.0.1:{port}/",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    value, unit = re.search(r"50%\s+([\d.]+)(us|ms|s)", out).groups()  # type: ignore[union-attr]
    p50 = float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    failed = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses:\s+(\d+)", out))
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors:
        failed += sum(int(n) for n in errors.groups())
    return rps, p50, failed


def h2load(port: int, authority: str, seconds: float) -> tuple[float, int]:
    """(requests/s, failed requests) of one h2load run over TLS (ALPN h2): 1 thread, 32 connections, 10
    concurrent streams each (h2load does not check the certificate; SNI is the URL's host)."""
    out = subprocess.run(
        [
            "h2load",
            "-t1",
            "-c32",
            "-m10",
            f"-D{max(1, round(seconds))}",
            "-H",
            f":authority: {authority}",
            f"https://127.0.0.1:{port}/",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]
    done = re.search(r"requests: \d+ total, \d+ started, \d+ done, \d+ succeeded, (\d+) failed, (\d+) errored", out)
    failed = sum(int(n) for n in done.groups()) if done else 0
    return rps, failed


@contextlib.contextmanager
def daemon(argv: list[str], port: int) -> Iterator[None]:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True).returncode:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{argv[0]} did not listen on {port}")
            time.sleep(0.05)
        yield
    finally:
        process.terminate()
        process.wait(10)


def nginx_conf(directory: Path, body: str) -> Path:
    conf = directory / "nginx.conf"
    conf.write_text(
        f"daemon off; worker_processes 1; pid {directory}/nginx.pid; error_log {directory}/error.log;\n"
        f"events {{ worker_connections 4096; }}\nhttp {{ access_log off;\n"
        f"client_body_temp_path {directory}; proxy_temp_path {directory}; fastcgi_temp_path {directory};\n"
        f"uwsgi_temp_path {directory}; scgi_temp_path {directory};\n{body}\n}}\n"
    )
    return conf


def hosts(count: int) -> list[str]:
    return [f"h{i}.bench" for i in range(count)]


async def measure(quick: bool) -> list[Row]:
    install()
    seconds = 1.0 if quick else 8.0
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="zattera-ingress-") as tmp:
        root = Path(tmp)
        backend_ports = [free_port(), free_port()]
        backend_dir = root / "backend"
        backend_dir.mkdir()
        listens = " ".join(f"listen 127.0.0.1:{p} reuseport;" for p in backend_ports)
        backend = nginx_conf(backend_dir, f'server {{ {listens} location / {{ return 200 "$server_port"; }} }}')
        with daemon(["nginx", "-c", str(backend)], backend_ports[0]):
            backend_addr = f"127.0.0.1:{backend_ports[0]}"
            for count in (1, 10_000):
                names = hosts(count)
                target = names[-1]
                direct = wrk(backend_ports[0], target, seconds)
                rows.append(row(f"backend directly, req/s ({count} envs)", direct[0], "req/s", "", "112,800 (issue)"))
                rows.append(row(f"backend directly, p50 ({count} envs)", direct[1], "ms"))
                hand = hand_haproxy(root / f"hand{count}", names, backend_addr, seconds)
                rows.append(row(f"HAProxy by hand, req/s ({count} envs)", hand[0], "req/s", "", "57,800 (issue)"))
                nginx = nginx_proxy(root / f"nginx{count}", names, backend_addr, seconds)
                rows.append(row(f"nginx proxy, req/s ({count} envs)", nginx[0], "req/s", "", "54,500 (issue)"))
                if count == 1:
                    python = python_proxy(root / "python", names, backend_addr, seconds)
                    rows.append(
                        row("Python proxy (--engine python), req/s (1 env)", python[0], "req/s", "", "7,000 (issue)")
                    )
                    rows.append(
                        row("Python proxy, added p50 (1 env)", python[1] - direct[1], "ms", "", "5.0 ms p50 (issue)")
                    )
                ours = await our_ingress(root / f"ours{count}", names, backend_ports, seconds, quick)
                rows.append(
                    row(
                        f"our ingress (HAProxy engine), req/s ({count} envs)", ours["rps"], "req/s", "≥ 50 % of HAProxy"
                    )
                )
                rows.append(
                    row(f"  share of hand-configured HAProxy ({count} envs)", 100 * ours["rps"] / hand[0], "%", "≥ 50")
                )
                rows.append(row(f"  added p50 over the backend ({count} envs)", ours["p50"] - direct[1], "ms", "≤ 0.5"))
                rows.append(
                    row(f"  route change applied → served p99 ({count} envs)", ours["change_p99"], "ms", "≤ 250")
                )
                rows.append(
                    row(
                        f"  … with wrk saturating the same cores ({count} envs)",
                        ours["change_p99_loaded"],
                        "ms",
                        "≤ 250",
                    )
                )
                rows.append(row(f"  failed requests during route changes ({count} envs)", ours["failed"], "", "0"))
            rows += await tls_and_websockets(root / "tls", backend_addr, seconds, 300 if quick else 3000)
    return rows


def hand_haproxy(directory: Path, names: list[str], backend_addr: str, seconds: float) -> tuple[float, float]:
    directory.mkdir()
    (directory / "hosts.map").write_text("".join(f"{name} be\n" for name in names))
    port = free_port()
    (directory / "h.cfg").write_text(
        f"global\n    nbthread 1\ndefaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n"
        f"    timeout server 30s\n    option http-keep-alive\nfrontend fe\n    bind 127.0.0.1:{port}\n"
        f"    use_backend %[req.hdr(host),lower,map({directory}/hosts.map)]\nbackend be\n"
        f"    server s1 {backend_addr}\n"
    )
    with daemon(["haproxy", "-db", "-f", str(directory / "h.cfg")], port):
        rps, p50, _ = wrk(port, names[-1], seconds)
    return rps, p50


def nginx_proxy(directory: Path, names: list[str], backend_addr: str, seconds: float) -> tuple[float, float]:
    directory.mkdir()
    port = free_port()
    entries = "".join(f"  {name} 1;\n" for name in names)
    conf = nginx_conf(
        directory,
        f"map_hash_bucket_size 128; map_hash_max_size 65536;\nmap $host $known {{ default 0;\n{entries}}}\n"
        f"upstream be {{ server {backend_addr}; keepalive 64; }}\n"
        f"server {{ listen 127.0.0.1:{port}; location / {{ if ($known = 0) {{ return 404; }}\n"
        f'  proxy_pass http://be; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}',
    )
    with daemon(["nginx", "-c", str(conf)], port):
        rps, p50, _ = wrk(port, names[-1], seconds)
    return rps, p50


def python_proxy(directory: Path, names: list[str], backend_addr: str, seconds: float) -> tuple[float, float]:
    """The fallback engine, serving its cached routes (the control plane is not needed for that)."""
    cache = directory / "cache"
    cache.mkdir(parents=True)
    (cache / ROUTES_CACHE_FILE).write_bytes(snapshot(names, backend_addr, backend_addr, 1).SerializeToString())
    port = free_port()
    argv = [sys.executable, "-m", "services.proxy", "--engine", "python", "--nats", "nats://127.0.0.1:1"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(cache), "--log-level", "ERROR"]
    with daemon(argv, port):
        rps, p50, _ = wrk(port, names[-1], seconds)
    return rps, p50


def snapshot(names: list[str], addr_of_last: str, other: str, version: int) -> cpb.RouteSnapshot:
    routes = []
    for index, name in enumerate(names):
        addr = addr_of_last if index == len(names) - 1 else other
        endpoint = _endpoint(f"a{index}-{addr.rpartition(':')[2]}", addr)
        routes.append(cpb.HTTPRoute(hostname=name, environment_id=f"e{index}", endpoints=[endpoint]))
    return cpb.RouteSnapshot(version=version, http_routes=routes)


@contextlib.asynccontextmanager
async def engine_serving(directory: Path, first: cpb.RouteSnapshot, port: int) -> AsyncIterator[HAProxyEngine]:
    layout = Layout(directory, f"127.0.0.1:{port}", "127.0.0.1:1", hold_timeout=60, connect_timeout=5)
    engine = HAProxyEngine(layout, node_id="n1")
    await engine.start(first)
    try:
        yield engine
    finally:
        await engine.stop()


async def route_changes(
    engine: HAProxyEngine, port: int, names: list[str], addrs: list[str], count: int, version: int
) -> list[float]:
    """ms from ``apply`` of a snapshot moving the last env to the other endpoint until a new connection
    is answered by it, ``count`` times (snapshots are built before the clock starts)."""
    delays: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
        for change in range(count):
            new = addrs[(change + 1) % 2]
            moved = snapshot(names, new, addrs[0], version + change + 1)
            started = time.perf_counter()
            await engine.apply(moved)
            while True:
                async with client.get(f"http://127.0.0.1:{port}/", headers={"Host": names[-1]}) as response:
                    if await response.text() == new.rpartition(":")[2]:
                        break
            delays.append(1000 * (time.perf_counter() - started))
    return delays


async def our_ingress(
    directory: Path, names: list[str], backend_ports: list[int], seconds: float, quick: bool
) -> dict[str, float]:
    port = free_port()
    addrs = [f"127.0.0.1:{p}" for p in backend_ports]
    changes = 10 if quick else 100
    async with engine_serving(directory, snapshot(names, addrs[0], addrs[0], 1), port) as engine:
        rps, p50, _ = await asyncio.to_thread(wrk, port, names[-1], seconds)
        idle = await route_changes(engine, port, names, addrs, changes, 1)
        load = asyncio.create_task(asyncio.to_thread(wrk, port, names[0], seconds + 2))
        loaded = await route_changes(engine, port, names, addrs, changes, 1 + changes)
        _, _, failed = await load
    return {
        "rps": rps,
        "p50": p50,
        "change_p99": percentile(idle, 99),
        "change_p99_loaded": percentile(loaded, 99),
        "failed": float(failed),
    }


async def _ws_echo(request: web.Request) -> web.WebSocketResponse:
    socket = web.WebSocketResponse()
    await socket.prepare(request)
    async for message in socket:
        await socket.send_str(message.data)
    return socket


async def ws_round_trip_ms(client: aiohttp.ClientSession, ws_url: str, host: str, count: int) -> float:
    """Median WebSocket echo round trip (ms) over one connection."""
    samples: list[float] = []
    async with client.ws_connect(ws_url, headers={"Host": host}) as socket:
        for _ in range(count):
            started = time.perf_counter()
            await socket.send_str("ping")
            await socket.receive_str()
            samples.append(1000 * (time.perf_counter() - started))
    return median(samples)


async def tls_and_websockets(directory: Path, backend_addr: str, seconds: float, certificates: int) -> list[Row]:
    """Our ingress with one env over TLS (keep-alive, and a new handshake per request) and a WebSocket
    echo round trip through it against the backend directly."""
    port, tls = free_port(), free_port()
    app = web.Application()
    app.router.add_get("/ws", _ws_echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    ws_addr = f"127.0.0.1:{runner.addresses[0][1]}"
    layout = Layout(directory / "haproxy", f"127.0.0.1:{port}", "127.0.0.1:1", 60, 5, tls_bind=f"127.0.0.1:{tls}")
    engine = HAProxyEngine(layout, node_id="n1")
    routes = [
        cpb.HTTPRoute(hostname="h0.bench", environment_id="e0", endpoints=[_endpoint("a0", backend_addr)]),
        cpb.HTTPRoute(hostname="ws.bench", environment_id="ews", endpoints=[_endpoint("aws", ws_addr)]),
    ]
    rows: list[Row] = []
    try:
        await engine.start(cpb.RouteSnapshot(version=1, http_routes=routes))
        await engine.set_certificates({"bench": self_signed_pem("h0.bench")})
        keepalive = await asyncio.to_thread(wrk, tls, "h0.bench", seconds, "https")
        handshakes = await asyncio.to_thread(wrk, tls, "h0.bench", seconds, "https", True)
        rows.append(row("our ingress over TLS, keep-alive (1 env)", keepalive[0], "req/s"))
        rows.append(row("our ingress over TLS, new handshake per request (1 env)", handshakes[0], "handshakes/s"))
        h2_rps, h2_failed = await asyncio.to_thread(h2load, tls, "h0.bench", seconds)
        h2_figure = f"our ingress, HTTP/2 over TLS (h2load, 32 connections x 10 streams; {h2_failed} failed)"
        rows.append(row(h2_figure, h2_rps, "req/s"))
        async with aiohttp.ClientSession() as client:
            direct = await ws_round_trip_ms(client, f"http://{ws_addr}/ws", "ws.bench", 200)
            through = await ws_round_trip_ms(client, f"http://127.0.0.1:{port}/ws", "ws.bench", 200)
        rows.append(row("WebSocket echo round trip, backend directly", direct, "ms"))
        rows.append(row("WebSocket echo round trip through our ingress", through, "ms"))
        rows += await many_certificates(engine, certificates)
    finally:
        await engine.stop()
        await runner.cleanup()
    return rows


async def many_certificates(engine: HAProxyEngine, count: int) -> list[Row]:
    """Install ``count`` certificates at run time (no reload), then replace one of them."""
    pems = {f"site{i}": self_signed_pem(f"site{i}.bench") for i in range(count)}
    started = time.perf_counter()
    await engine.set_certificates(pems)
    installed = time.perf_counter() - started
    pems["site0"] = self_signed_pem("site0.bench")
    started = time.perf_counter()
    await engine.set_certificates(pems)
    replaced = time.perf_counter() - started
    return [
        row(f"install {count} certificates at run time (no reload)", installed, "s"),
        row(f"replace one certificate among {count}", 1000 * replaced, "ms"),
    ]


def _endpoint(assignment_id: str, addr: str) -> cpb.Endpoint:
    return cpb.Endpoint(assignment_id=assignment_id, node_id="n1", addr=addr, healthy=True)


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(measure(quick))


def main() -> None:
    bench_main("Ingress data path", run, __doc__, "8 s wrk runs, 100 route changes")


if __name__ == "__main__":
    main()
