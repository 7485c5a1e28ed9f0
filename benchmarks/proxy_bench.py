"""Metrics overhead on the proxy's hot path: requests/s through the real proxy process with its Prometheus
metrics off and on, side by side.

Run: ``python -m benchmarks.proxy_bench [--full] [--json]`` (also part of ``make bench``).

Measured on the Python data plane (``--engine python``), where the proxy's own code records every
request; under HAProxy (the default where it is installed) the same series are filled from HAProxy's stats
socket once per heartbeat, with no work per request, so there is nothing to measure on that path.

The proxy's route cache holds one route (``bench.localhost`` → one upstream; an embedded NATS takes its
heartbeats); the upstream is a minimal aiohttp
server in its own process answering 2 bytes. The proxy runs as ``python -m services.proxy``, once without
``--metrics-port`` and once with it (every request then records one latency histogram point by env and
status class), alternating off/on for several rounds so that drift on the shared machine hits both alike.
This process drives keep-alive load with a fixed number of concurrent clients for a fixed time per round,
counts the answered requests and reads the proxy process's CPU time (psutil) before and after; the
/metrics endpoint is scraped once per "on" round (as Prometheus would every 15 s). Quick: 3 rounds of
2.5 s per mode; full: 5 rounds of 10 s. The three processes share the machine's 2 cores (with whatever
else runs), so the rate moves with the machine's load; the overhead is taken from the proxy's CPU time
per request, which other work does not inflate.

Target: metrics cost ≤ 5 % of the proxy's requests/s. Anchor: kamal-proxy and Fly's proxy export the same
kind of per-service request histogram.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
from zattera.cluster.v1 import cluster_pb2 as cpb

from benchmarks.common import Row, bench_main, embedded_server, median, row
from services.proxy.settings import ROUTES_CACHE_FILE
from shared.embedded import free_port
from shared.files import write_atomic
from shared.metrics import RequestSeries

HOST = "bench.localhost"
ENV = "bench-env"
CONCURRENCY = 32
UPSTREAM = """
import sys
from aiohttp import web

async def ok(request):
    return web.Response(body=b"ok")

app = web.Application()
app.router.add_get("/", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def cache_route(cache: Path, upstream: str) -> None:
    """The proxy's route cache holding the one route (it serves from it at once, before any snapshot)."""
    endpoint = cpb.Endpoint(assignment_id="a1", node_id="n1", addr=upstream, healthy=True)
    route = cpb.HTTPRoute(hostname=HOST, environment_id=ENV, endpoints=[endpoint])
    cache.mkdir(parents=True, exist_ok=True)
    snapshot = cpb.RouteSnapshot(version=1, http_routes=[route])
    write_atomic(cache / ROUTES_CACHE_FILE, snapshot.SerializeToString(deterministic=True))


@contextlib.asynccontextmanager
async def process(argv: list[str], ready_url: str, headers: dict[str, str] | None = None) -> AsyncIterator[int]:
    """A child process, until ``ready_url`` answers 200 (then its pid is yielded), stopped afterwards."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(ready_url, headers=headers) as response:
                        if response.status == 200:
                            break
                if time.monotonic() > deadline or proc.returncode is not None:
                    raise RuntimeError(f"{argv[2]} did not come up ({ready_url})")
                await asyncio.sleep(0.05)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def load(port: int, seconds: float) -> tuple[float, int]:
    """(requests/s, requests) answered 200 through the proxy by :data:`CONCURRENCY` keep-alive clients."""
    url = f"http://127.0.0.1:{port}/"
    headers = {"Host": HOST}
    answered = 0
    stop_at = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal answered
        while time.monotonic() < stop_at:
            async with session.get(url, headers=headers) as response:
                await response.read()
                answered += response.status == 200

    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
        return answered / (time.monotonic() - started), answered


@dataclass(frozen=True)
class Round:
    rate: float
    """requests/s answered"""
    cpu_per_request: float
    """CPU seconds the proxy process spent per answered request (robust to other work on the machine)"""


async def one_round(nats_url: str, cache: Path, upstream: str, *, metrics: bool, seconds: float) -> Round:
    cache_route(cache, upstream)
    port = free_port()
    argv = [sys.executable, "-m", "services.proxy", "--engine", "python", "--nats", nats_url, "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    argv += ["--proxy-id", "bench", "--node-id", "n1", "--cache-dir", str(cache), "--log-level", "WARNING"]
    metrics_port = free_port()
    if metrics:
        argv += ["--metrics-port", str(metrics_port)]
    async with process(argv, f"http://127.0.0.1:{port}/", {"Host": HOST}) as pid:
        await load(port, 0.5)  # warm-up: connections, the route table, the first histogram points
        proxy = psutil.Process(pid)
        before = proxy.cpu_times()
        rate, answered = await load(port, seconds)
        after = proxy.cpu_times()
        if metrics:
            async with aiohttp.ClientSession() as session:
                scraped = await (await session.get(f"http://127.0.0.1:{metrics_port}/metrics")).text()
            assert f'env="{ENV}"' in scraped, "the proxy recorded no request"
        cpu = (after.user + after.system) - (before.user + before.system)
        return Round(rate, cpu / max(answered, 1))


async def _measure(quick: bool) -> list[Row]:
    rounds, seconds = (3, 2.5) if quick else (5, 10.0)
    results: dict[bool, list[Round]] = {False: [], True: []}
    with embedded_server("zattera-proxy-bench-") as nats, tempfile.TemporaryDirectory() as tmp:
        upstream_port = free_port()
        upstream = f"127.0.0.1:{upstream_port}"
        async with process([sys.executable, "-c", UPSTREAM, str(upstream_port)], f"http://{upstream}/"):
            for index in range(rounds):
                for metrics in (False, True) if index % 2 == 0 else (True, False):
                    cache = Path(tmp) / f"cache-{index}-{metrics}"
                    results[metrics].append(
                        await one_round(nats.url, cache, upstream, metrics=metrics, seconds=seconds)
                    )
    rate = {m: median([r.rate for r in rs]) for m, rs in results.items()}
    cpu_us = {m: 1e6 * median([r.cpu_per_request for r in rs]) for m, rs in results.items()}
    overhead = 100.0 * (cpu_us[True] - cpu_us[False]) / cpu_us[False]
    work_us = metrics_work_per_request()
    note = f"median of {rounds} rounds of {seconds:g} s, {CONCURRENCY} keep-alive clients, 2-byte answers"
    return [
        row("proxy requests/s, metrics off", rate[False], "req/s", "", note),
        row("proxy requests/s, metrics on", rate[True], "req/s", "", "same; one histogram point per request"),
        row("proxy CPU per request, metrics off", cpu_us[False], "µs", "", "CPU time of the proxy process"),
        row("proxy CPU per request, metrics on", cpu_us[True], "µs", "", "same"),
        row("proxy metrics overhead, side by side (CPU per request)", overhead, "%", "≤ 5 %", "noisy: ±10 % here"),
        row("metrics work per request (timer + histogram point)", work_us, "µs", "", "in process, 200,000 calls"),
        row(
            "metrics work / proxy CPU per request",
            100.0 * work_us / cpu_us[False],
            "%",
            "≤ 5 %",
            "kamal-proxy, Fly: same histogram",
        ),
    ]


def metrics_work_per_request(calls: int = 200_000) -> float:
    """What ``Proxy._measured`` adds to a request, in µs: two clock reads and one histogram point."""
    series = RequestSeries()
    clock = time.perf_counter
    started = clock()
    for _ in range(calls):
        begun = clock()
        series.observe(ENV, 200, clock() - begun)
    return 1e6 * (clock() - started) / calls


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_measure(quick))


def main() -> None:
    bench_main("Proxy metrics overhead", run, __doc__, "5 rounds of 10 s per mode")


if __name__ == "__main__":
    main()
