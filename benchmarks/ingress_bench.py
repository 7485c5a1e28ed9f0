"""Ingress data path side by side (issues 18, 32, 42): at 1 and 10,000 envs, one nginx backend answering a
fixed 200:

* the backend directly, nginx as a proxy (1 worker, ``map $host``, keep-alive upstream) and the Python
  proxy (``--engine python``, the fallback; 1 env): one wrk run each, for scale;
* our ingress — HAProxy driven by :class:`services.proxy.haproxy_engine.HAProxyEngine` in this process, the
  code the proxy runs — and a hand-configured HAProxy (:func:`benchmarks.side_by_side.hand_config`: the
  same hosts in a map to one backend, a crt-list with the same certificates) under the loads of
  :mod:`benchmarks.side_by_side` (HTTP and HTTPS keep-alive, a new connection per request with and without
  session resumption, h2), in alternating rounds, with each HAProxy's CPU time per request.

Our ingress gets everything the way a running proxy does: it starts with every env's route but no replica
(each backend empty, as when routes come before replicas), then one snapshot brings every env its endpoint
(``add server`` through the runtime API: timed), then every env's certificate arrives (``set_certificates``:
``new ssl cert`` + ``add ssl crt-list`` at run time: timed). The bench fails if any of it took a reload.
Not exercised: NATS, the route builder and the certificate service (``ingress_up_bench`` goes through a
real ``zattera up``).

Then, on our ingress: route change applied (``apply`` called → the new endpoint served) p99 over repeated
endpoint moves, idle and under wrk load, failed requests during those changes, and a WebSocket echo round
trip (1 env).

``python -m benchmarks.ingress_bench [--full]``: quick, 1 round of 1 s per load and side, 1,000
certificates at the large size, 10 route changes; full, 3 rounds of 8 s, 10,000 certificates, 100 changes.
wrk, h2load (nghttp2-client), nginx and haproxy are Debian packages installed with
``deploy/system-packages.sh`` when missing (root), else the bench says what to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
from benchmarks.side_by_side import Side, check_certificate, hand_haproxy, haproxy_worker, measure, rows, wrk
from services.proxy.haproxy_certs import self_signed_pem
from services.proxy.haproxy_config import Layout
from services.proxy.haproxy_engine import HAProxyEngine
from services.proxy.settings import ROUTES_CACHE_FILE
from shared.embedded import free_port
from shared.security.creds import write_private

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wrk", "nginx", "haproxy", "nghttp2-client")  # nghttp2-client: h2load


def install() -> None:
    subprocess.run([str(ROOT / "deploy" / "system-packages.sh"), *PACKAGES], check=True)


@contextlib.contextmanager
def daemon(argv: list[str], port: int) -> Iterator[None]:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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


def certificates(directory: Path, names: list[str]) -> dict[str, Path]:
    """A self-signed certificate (P-256, chain + key in one PEM, 0600) per name: name → file."""
    directory.mkdir(parents=True)
    files = {}
    for name in names:
        files[name] = directory / f"{name}.pem"
        write_private(files[name], self_signed_pem(name))
    return files


async def measure_all(quick: bool) -> list[Row]:
    install()
    seconds, rounds = (1.0, 1) if quick else (8.0, 3)
    large_certificates = 1_000 if quick else 10_000
    out: list[Row] = []
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
                scale = f"{count:,} env{'s' if count > 1 else ''}"
                direct = wrk(f"http://{backend_addr}/", target, seconds)
                out.append(row(f"backend directly, req/s ({scale})", direct.rate, "req/s", "", "112,800 (issue 18)"))
                out.append(row(f"backend directly, p50 ({scale})", direct.p50_ms, "ms"))
                nginx = nginx_proxy(root / f"nginx{count}", names, backend_addr, seconds)
                out.append(row(f"nginx proxy, req/s ({scale})", nginx, "req/s", "", "54,500 (issue 18)"))
                if count == 1:
                    python = python_proxy(root / "python", names, backend_addr, seconds)
                    out.append(row("Python proxy (--engine python), req/s (1 env)", python[0], "req/s", "", ""))
                    out.append(row("Python proxy, added p50 (1 env)", python[1] - direct.p50_ms, "ms", "", ""))
                certified = names[-min(count, large_certificates) :]
                files = certificates(root / f"certs{count}", certified)
                scale_tls = f"{scale}, {len(certified):,} certificate{'s' if len(certified) > 1 else ''}"
                compared, ours_p50 = await ours_and_hand(
                    root / f"n{count}", names, files, backend_ports, seconds, rounds, scale_tls, quick
                )
                out += compared
                out.append(
                    row(
                        f"  added p50 over the backend, HTTP keep-alive ({scale})",
                        ours_p50 - direct.p50_ms,
                        "ms",
                        "≤ 0.5",
                    )
                )
            out += await websockets(root / "ws")
    return out


async def ours_and_hand(
    directory: Path,
    names: list[str],
    files: dict[str, Path],
    backend_ports: list[int],
    seconds: float,
    rounds: int,
    scale: str,
    quick: bool,
) -> tuple[list[Row], float]:
    """Our ingress (endpoints and certificates added at run time) and the hand-configured HAProxy side by
    side, then route changes on ours; (rows, our p50 under HTTP keep-alive)."""
    addrs = [f"127.0.0.1:{p}" for p in backend_ports]
    target = names[-1]
    envs = f"{len(names):,} env{'s' if len(names) > 1 else ''}"
    out: list[Row] = []
    async with engine_serving(directory / "ours", names, addrs[0]) as (engine, side, timings):
        out.append(row(f"{envs}: every endpoint added at run time (one snapshot applied)", timings["endpoints"], "s"))
        pems = {name: path.read_text() for name, path in files.items()}
        started = time.perf_counter()
        async with loop_lag() as lag:
            await engine.set_certificates(pems)
        out.append(row(f"{scale}: certificates installed at run time (no reload)", time.perf_counter() - started, "s"))
        out.append(row(f"{scale}: … longest the event loop was held meanwhile", 1000 * lag[0], "ms", "≤ 1,000"))
        if engine.reloads:
            raise RuntimeError(f"{engine.reloads} reload(s): not the runtime path a running proxy takes")
        hand_ports = (free_port(), free_port())
        with hand_haproxy(directory / "hand", names, addrs[0], list(files.values()), hand_ports) as hand:
            for tls in (side, hand):
                check_certificate(tls, target, files[target])
            results = await asyncio.to_thread(
                measure, [side, hand], target, rounds=rounds, seconds=seconds, progress=_progress
            )
        out += rows(results, scale)
        changes = 10 if quick else 100
        idle = await route_changes(engine, side.http_port, names, addrs, changes, 2)
        load = asyncio.create_task(asyncio.to_thread(wrk, f"http://127.0.0.1:{side.http_port}/", names[0], seconds + 2))
        loaded = await route_changes(engine, side.http_port, names, addrs, changes, 2 + changes)
        failed = (await load).failed
        replaced = await replace_one_certificate(engine, pems)
    out += [
        row(f"  route change applied → served p99 ({envs})", percentile(idle, 99), "ms", "≤ 250"),
        row(f"  … with wrk saturating the same cores ({envs})", percentile(loaded, 99), "ms", "≤ 250"),
        row(f"  failed requests during route changes ({envs})", failed, "", "0"),
        row(f"  replace one certificate among {len(pems):,}", 1000 * replaced, "ms"),
    ]
    return out, median([s.p50_ms for s in results.of("http", "ours")])


def nginx_proxy(directory: Path, names: list[str], backend_addr: str, seconds: float) -> float:
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
        return wrk(f"http://127.0.0.1:{port}/", names[-1], seconds).rate


def python_proxy(directory: Path, names: list[str], backend_addr: str, seconds: float) -> tuple[float, float]:
    """The fallback engine, serving its cached routes (the control plane is not needed for that)."""
    cache = directory / "cache"
    cache.mkdir(parents=True)
    (cache / ROUTES_CACHE_FILE).write_bytes(snapshot(names, backend_addr, backend_addr, 1).SerializeToString())
    port = free_port()
    argv = [sys.executable, "-m", "services.proxy", "--engine", "python", "--nats", "nats://127.0.0.1:1"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(cache), "--log-level", "ERROR"]
    with daemon(argv, port):
        run = wrk(f"http://127.0.0.1:{port}/", names[-1], seconds)
    return run.rate, run.p50_ms


def snapshot(names: list[str], addr_of_last: str, other: str, version: int) -> cpb.RouteSnapshot:
    routes = []
    for index, name in enumerate(names):
        addr = addr_of_last if index == len(names) - 1 else other
        endpoint = _endpoint(f"a{index}-{addr.rpartition(':')[2]}", addr)
        routes.append(cpb.HTTPRoute(hostname=name, environment_id=f"e{index}", endpoints=[endpoint]))
    return cpb.RouteSnapshot(version=version, http_routes=routes)


def without_replicas(names: list[str], version: int) -> cpb.RouteSnapshot:
    """Every env's route with no endpoint yet (its backend is configured, empty)."""
    routes = [cpb.HTTPRoute(hostname=name, environment_id=f"e{index}") for index, name in enumerate(names)]
    return cpb.RouteSnapshot(version=version, http_routes=routes)


@contextlib.asynccontextmanager
async def engine_serving(
    directory: Path, names: list[str], addr: str
) -> AsyncIterator[tuple[HAProxyEngine, Side, dict[str, float]]]:
    """Our engine with an HTTP and a TLS listener: started with every route and no replica, then given
    every env's endpoint at run time (timed: ``endpoints``, seconds)."""
    port, tls = free_port(), free_port()
    layout = Layout(directory, f"127.0.0.1:{port}", "127.0.0.1:1", 60, 5, tls_bind=f"127.0.0.1:{tls}")
    engine = HAProxyEngine(layout, node_id="n1")
    await engine.start(without_replicas(names, 1))
    try:
        started = time.perf_counter()
        await engine.apply(snapshot(names, addr, addr, 2))
        endpoints = time.perf_counter() - started
        side = Side("ours", port, tls, await haproxy_worker(layout.stats_socket))
        yield engine, side, {"endpoints": endpoints}
    finally:
        await engine.stop()


@contextlib.asynccontextmanager
async def loop_lag() -> AsyncIterator[list[float]]:
    """[the longest stretch, in seconds, the event loop went without running a task woken every 5 ms], filled
    in when the block ends (the probe runs before the block starts)."""
    result = [0.0]
    ticks: list[float] = []

    async def probe() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0)  # the probe's first tick
    try:
        yield result
    finally:
        task.cancel()
        stamps = [*ticks, time.perf_counter()]
        result[0] = max(b - a for a, b in itertools.pairwise(stamps))


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


async def replace_one_certificate(engine: HAProxyEngine, pems: dict[str, str]) -> float:
    """Seconds to swap one certificate among ``pems`` at run time."""
    first = next(iter(pems))
    renewed = {**pems, first: self_signed_pem(first)}
    started = time.perf_counter()
    await engine.set_certificates(renewed)
    return time.perf_counter() - started


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


async def websockets(directory: Path) -> list[Row]:
    """A WebSocket echo round trip through our ingress against the backend directly."""
    port = free_port()
    app = web.Application()
    app.router.add_get("/ws", _ws_echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    ws_addr = f"127.0.0.1:{runner.addresses[0][1]}"
    engine = HAProxyEngine(Layout(directory, f"127.0.0.1:{port}", "127.0.0.1:1", 60, 5), node_id="n1")
    route = cpb.HTTPRoute(hostname="ws.bench", environment_id="ews", endpoints=[_endpoint("aws", ws_addr)])
    try:
        await engine.start(cpb.RouteSnapshot(version=1, http_routes=[route]))
        async with aiohttp.ClientSession() as client:
            direct = await ws_round_trip_ms(client, f"http://{ws_addr}/ws", "ws.bench", 200)
            through = await ws_round_trip_ms(client, f"http://127.0.0.1:{port}/ws", "ws.bench", 200)
    finally:
        await engine.stop()
        await runner.cleanup()
    return [
        row("WebSocket echo round trip, backend directly", direct, "ms"),
        row("WebSocket echo round trip through our ingress", through, "ms"),
    ]


def _endpoint(assignment_id: str, addr: str) -> cpb.Endpoint:
    return cpb.Endpoint(assignment_id=assignment_id, node_id="n1", addr=addr, healthy=True)


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(measure_all(quick))


def main() -> None:
    bench_main("Ingress data path", run, __doc__, "3 rounds of 8 s per load, 10,000 certificates, 100 route changes")


if __name__ == "__main__":
    main()
