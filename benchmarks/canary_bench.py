"""Canary weights in the data plane (issue 41): how fast a weight change reaches every proxy, how closely
the proxies follow the configured share, and what weighting costs a proxy per request.

``python -m benchmarks.canary_bench [--full] [--json]``.

What runs for real: an embedded nats-server, the route service's publisher (:class:`RoutesPublisher`, in
this process, on its own connection and state view), two proxy processes (``python -m services.proxy``, one
``--engine haproxy`` with its HAProxy 2.6, one ``--engine python``), and four upstreams (two replicas of the
stable release, two of the canary, one aiohttp process answering each release's id). **Bypassed:** the
orchestrator and the agents — this process writes the records they would (nodes, assignments with their
observed HEALTHY state, and the deployment at its CANARY step with its weight, as the canary phase's
fenced step writes it).

Figures:

* **weight change → applied by every proxy**: from the deployment write with a new weight to the first
  heartbeat of EACH proxy reporting a route version that includes it (``routes_version``; the HAProxy
  proxy reports a version only once HAProxy applied it — ``set server … weight`` over the runtime API, no
  reload). Heartbeats every 10 ms here (the resolution of the figure). Target p99 ≤ 250 ms (the routes
  bound).
* **share of requests to the canary vs the configured weight**, 10,000 requests per proxy at 5 % and 25 %,
  each request without a cookie (drawn afresh). Target: within ±1 point.
* **CPU per request at the proxy, weights on vs off**, in the same run: the proxy's CPU time (the HAProxy
  worker's for the HAProxy engine, the Python process's for the Python one) over a fixed number of
  keep-alive requests, a weighted route (4 servers, weights, the pinning cookie set on each answer) then the
  same env unweighted (its stable release only), alternating.
* **CPU per request at the proxy, latency log on vs off** (HAProxy engine): two more HAProxy proxies side
  by side, ``ZATTERA_PROXY_LATENCY_LOG`` true and false, the weighted route at 25 %; the CPU time of the
  HAProxy worker plus the proxy process (which reads and counts the log lines) per request (from
  ``schedstat``: ns, not the 10-ms tick), rounds alternating between them, every round reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, median, percentile, row
from benchmarks.side_by_side import cpu_seconds, haproxy_worker
from services.proxy.haproxy_config import Layout
from services.routes.publisher import RoutesPublisher
from shared import keys as K
from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats, free_port
from shared.live import LiveView
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer

DOMAIN = "bench.localhost"
HOST = "api-production.bench.localhost"
ENV = "01ENVBENCH"
STABLE, CANARY = "01RELSTABLE", "01RELCANARY"
UPSTREAMS = """
import sys
from aiohttp import web

async def main():
    for arg in sys.argv[1:]:
        name, port = arg.split("=")
        app = web.Application()
        app.router.add_get("/", lambda request, name=name: web.Response(text=name))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(port)).start()
    await asyncio.Event().wait()

import asyncio
asyncio.run(main())
"""


def records(ports: dict[str, int]) -> list[object]:
    project = pb.Project(name="bench")
    project.meta.id = "01PROJ"
    app = pb.App(project_id="01PROJ", name="api")
    app.meta.id = "01APP"
    env = pb.Environment(project_id="01PROJ", app_id="01APP", name="production", active_release_id=STABLE)
    env.meta.id = ENV
    env.service.replicas.min = 2
    env.route_generation = 1
    node = pb.Node(name="n1", status=pb.NODE_STATUS_ALIVE)
    node.meta.id = "n1"
    out: list[object] = [project, app, env, node]
    for name, port in ports.items():
        a = pb.Assignment(
            node_id="n1",
            environment_id=ENV,
            release_id=STABLE if name.startswith("stable") else CANARY,
            desired=pb.ASSIGNMENT_DESIRED_RUN,
            project_id="01PROJ",
            app_id="01APP",
        )
        a.meta.id = f"01A{name.upper():>23}".replace(" ", "0")
        a.mesh_port_bindings["http"] = port
        observed = pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY)
        observed.mesh_port_bindings["http"] = port
        out += [a, (K.observed("n1", a.meta.id), observed)]
    return out


def deployment(weight: int, phase: int = pb.DEPLOYMENT_PHASE_CANARY) -> pb.Deployment:
    d = pb.Deployment(
        environment_id=ENV,
        project_id="01PROJ",
        app_id="01APP",
        release_id=CANARY,
        previous_release_id=STABLE,
        phase=phase,  # type: ignore[arg-type]
    )
    d.meta.id = "01DEPBENCH"
    d.canary.weight = weight
    return d


@contextlib.asynccontextmanager
async def proxy(
    nats_url: str, root: Path, engine: str, name: str = "", **settings: str
) -> AsyncIterator[tuple[int, int]]:
    """A proxy process (heartbeats every 10 ms unless ``settings`` say otherwise: ``ZATTERA_PROXY_*``)."""
    port = free_port()
    name = name or engine
    env = {**os.environ, "ZATTERA_PROXY_HEARTBEAT_INTERVAL": "0.01", "ZATTERA_DOMAIN": DOMAIN}
    env.update({f"ZATTERA_PROXY_{key.upper()}": value for key, value in settings.items()})
    argv = [sys.executable, "-m", "services.proxy", "--nats", nats_url, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--proxy-id", name, "--node-id", "n1", "--cache-dir", str(root / name), "--engine", engine]
    log = (root / f"{name}.log").open("wb")
    process = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield port, process.pid
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


async def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def shares(port: int, requests: int) -> Counter[str]:
    """Answers by release over ``requests`` requests, 64 at a time, keep-alive, no cookie kept."""
    counts: Counter[str] = Counter()
    jar = aiohttp.DummyCookieJar()
    async with aiohttp.ClientSession(cookie_jar=jar, connector=aiohttp.TCPConnector(limit=64)) as session:

        async def one() -> None:
            async with session.get(f"http://127.0.0.1:{port}/", headers={"Host": HOST}) as response:
                counts[(await response.text()).split("-")[0] if response.status == 200 else str(response.status)] += 1

        for start in range(0, requests, 64):
            await asyncio.gather(*(one() for _ in range(min(64, requests - start))))
    return counts


async def proxy_cpu(port: int, pid_of: object, requests: int) -> float:
    """CPU seconds per request of the serving process over ``requests`` requests."""
    pid = await pid_of()  # type: ignore[operator]
    before = cpu_seconds(pid)
    await shares(port, requests)
    return (cpu_seconds(pid) - before) / requests


def cpu_ns(pid: int) -> int:
    """CPU time of a process's live threads in ns (``/proc/<pid>/task/*/schedstat``: no 10-ms tick)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


async def ingress_cpu(port: int, pids: list[int], requests: int) -> float:
    """CPU seconds per request of HAProxy's worker and the proxy process together over ``requests``."""
    before = sum(cpu_ns(pid) for pid in pids)
    await shares(port, requests)
    return (sum(cpu_ns(pid) for pid in pids) - before) / 1e9 / requests


def stats_socket(root: Path, name: str) -> Path:
    return Layout(root / name / "haproxy", "", "", 0.0, 0.0).stats_socket


async def _measure(quick: bool) -> list[Row]:
    changes = 20 if quick else 100
    share_requests = 10_000
    cpu_requests = 3000 if quick else 10_000
    cpu_rounds = 2 if quick else 4
    with tempfile.TemporaryDirectory(prefix="zattera-canary-bench-") as tmp:
        root = Path(tmp)
        server = EmbeddedNats(data_dir=root / "nats").start()
        names = ["stable-0", "stable-1", "canary-0", "canary-1"]
        ports = {name: free_port() for name in names}
        upstreams = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-c", UPSTREAMS, *(f"{n}={p}" for n, p in ports.items())], start_new_session=True
        )
        conns: list[Connection] = []
        try:
            conn = await connect(server.url, name="bench")
            conns.append(conn)
            await provision(conn.js)
            view = StateView(conn, name="bench-writer")
            await view.start()
            writer = Writer(conn, view)
            txn = writer.txn()
            for item in records(ports):
                if isinstance(item, tuple):
                    txn.put(item[1], key=item[0])
                else:
                    txn.put(item)  # type: ignore[arg-type]
            txn.put(deployment(5))
            await writer.commit(txn)
            routes_conn = await connect(server.url, name="bench-routes")
            conns.append(routes_conn)
            routes_view = StateView(routes_conn, name="bench-routes")
            await routes_view.start()
            publisher = RoutesPublisher(routes_conn, routes_view, domain=DOMAIN, clock=RealClock())
            publishing = asyncio.create_task(publisher.run())
            await asyncio.wait_for(publisher.ready.wait(), 30)
            live = LiveView(conn, RealClock(), watched=True)
            await live.start()

            def versions() -> dict[str, int]:
                return {hb.proxy_id: hb.routes_version for hb in live.fresh_proxy_heartbeats()}

            async with (
                proxy(server.url, root, "haproxy") as (haproxy_port, _),
                proxy(server.url, root, "python") as (py_port, py_pid),
            ):
                rev = view.rev(K.deployment("01DEPBENCH"))
                await wait_for(lambda: len(versions()) == 2 and min(versions().values()) >= rev, 60, "both proxies")
                # 1. weight change -> applied by every proxy
                every: list[float] = []
                each: dict[str, list[float]] = {"haproxy": [], "python": []}
                for i in range(changes):
                    weight = 25 if i % 2 == 0 else 5
                    current = view.deployment("01DEPBENCH")
                    assert current is not None
                    changed = pb.Deployment()
                    changed.CopyFrom(current)
                    changed.canary.weight = weight
                    started = time.perf_counter()
                    await writer.commit(writer.txn().put(changed))
                    rev = view.rev(K.deployment("01DEPBENCH"))
                    seen: dict[str, float] = {}
                    while len(seen) < 2:
                        for proxy_id, version in versions().items():
                            if version >= rev and proxy_id not in seen:
                                seen[proxy_id] = (time.perf_counter() - started) * 1000
                        if time.perf_counter() - started > 10:
                            raise RuntimeError(f"weight change {i} not applied within 10 s: {versions()}")
                        await asyncio.sleep(0.001)
                    for proxy_id, ms in seen.items():
                        each[proxy_id].append(ms)
                    every.append(max(seen.values()))
                rows = [
                    row("weight change → applied by every proxy, p50", median(every), "ms"),
                    row(
                        "weight change → applied by every proxy, p99",
                        percentile(every, 99),
                        "ms",
                        "≤ 250 ms",
                        f"{changes} changes; heartbeats every 10 ms (the resolution)",
                    ),
                    row("  … HAProxy proxy alone, p99", percentile(each["haproxy"], 99), "ms"),
                    row("  … Python proxy alone, p99", percentile(each["python"], 99), "ms"),
                ]
                # 2. share vs weight
                for weight in (25, 5):  # each a change (the last weight above was 5)
                    current = view.deployment("01DEPBENCH")
                    assert current is not None
                    changed = pb.Deployment()
                    changed.CopyFrom(current)
                    changed.canary.weight = weight
                    await writer.commit(writer.txn().put(changed))
                    rev = view.rev(K.deployment("01DEPBENCH"))
                    await wait_for(lambda: min(versions().values()) >= rev, 10, "the weight")  # noqa: B023
                    for engine, port in (("haproxy", haproxy_port), ("python", py_port)):
                        counts = await shares(port, share_requests)
                        share = 100 * counts["canary"] / max(sum(counts.values()), 1)
                        rows.append(
                            row(
                                f"canary share at {weight} %, {engine} ({share_requests:,} requests)",
                                round(share, 2),
                                "%",
                                f"{weight} ± 1",
                                f"off by {share - weight:+.2f} points; answers {dict(counts)}",
                            )
                        )
                # 3. CPU per request, weights on vs off
                socket = stats_socket(root, "haproxy")

                async def haproxy_pid() -> int:
                    return await haproxy_worker(socket)

                async def python_pid() -> int:
                    return py_pid

                cpu: dict[tuple[str, bool], list[float]] = {}
                for _ in range(cpu_rounds):
                    for weighted in (True, False):
                        current = view.deployment("01DEPBENCH")
                        assert current is not None
                        changed = pb.Deployment()
                        changed.CopyFrom(current)
                        changed.canary.weight = 25
                        changed.phase = pb.DEPLOYMENT_PHASE_CANARY if weighted else pb.DEPLOYMENT_PHASE_PROMOTING
                        await writer.commit(writer.txn().put(changed))
                        rev = view.rev(K.deployment("01DEPBENCH"))
                        await wait_for(lambda: min(versions().values()) >= rev, 10, "the routes")  # noqa: B023
                        for engine, port, pid_of in (
                            ("haproxy", haproxy_port, haproxy_pid),
                            ("python", py_port, python_pid),
                        ):
                            cpu.setdefault((engine, weighted), []).append(await proxy_cpu(port, pid_of, cpu_requests))
                for engine in ("haproxy", "python"):
                    on, off = median(cpu[(engine, True)]), median(cpu[(engine, False)])
                    rows.append(row(f"proxy CPU per request, {engine}, weights off", round(off * 1e6, 1), "µs"))
                    rows.append(
                        row(
                            f"proxy CPU per request, {engine}, weights on",
                            round(on * 1e6, 1),
                            "µs",
                            "",
                            f"{100 * (on - off) / off:+.1f} % ({cpu_rounds} rounds × {cpu_requests:,} requests)",
                        )
                    )
            # 4. CPU per request at the proxy (HAProxy + the proxy process), latency log on vs off
            rows += await _latency_log_cpu(server.url, root, view, writer, live, 2 * cpu_requests, 2 * cpu_rounds + 1)
            publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publishing
            await live.stop()
        finally:
            for c in conns:
                with contextlib.suppress(Exception):
                    await c.close()
            upstreams.terminate()
            upstreams.wait(10)
            server.stop()
    return rows


async def _latency_log_cpu(
    nats_url: str, root: Path, view: StateView, writer: Writer, live: LiveView, requests: int, rounds: int
) -> list[Row]:
    """Two HAProxy proxies side by side, the request log on in one and off in the other (heartbeats every
    2 s, the default), the canary's weighted route at 25 %; rounds alternate between them."""
    current = view.deployment("01DEPBENCH")
    assert current is not None
    changed = pb.Deployment()
    changed.CopyFrom(current)
    changed.canary.weight, changed.phase = 25, pb.DEPLOYMENT_PHASE_CANARY
    await writer.commit(writer.txn().put(changed))
    rev = view.rev(K.deployment("01DEPBENCH"))
    names = {True: "haproxy-log", False: "haproxy-nolog"}
    async with (
        proxy(nats_url, root, "haproxy", names[True], heartbeat_interval="2", latency_log="true") as (on_port, on_pid),
        proxy(nats_url, root, "haproxy", names[False], heartbeat_interval="2", latency_log="false") as (
            off_port,
            off_pid,
        ),
    ):

        def served() -> bool:
            versions = {hb.proxy_id: hb.routes_version for hb in live.fresh_proxy_heartbeats()}
            return all(versions.get(name, 0) >= rev for name in names.values())

        await wait_for(served, 60, "the two HAProxy proxies")
        ports = {True: on_port, False: off_port}
        pids = {
            True: [on_pid, await haproxy_worker(stats_socket(root, names[True]))],
            False: [off_pid, await haproxy_worker(stats_socket(root, names[False]))],
        }
        for logging in (True, False):  # warm-up: connections, the first lines
            await shares(ports[logging], 500)
        cpu: dict[bool, list[float]] = {True: [], False: []}
        for index in range(rounds):
            order = (True, False) if index % 2 == 0 else (False, True)
            for logging in order:
                cpu[logging].append(await ingress_cpu(ports[logging], pids[logging], requests))
        proxy_only = {logging: cpu_ns(pids[logging][0]) / 1e9 for logging in (True, False)}
    on, off = median(cpu[True]), median(cpu[False])
    rounds_text = {k: ", ".join(f"{v * 1e6:.1f}" for v in values) for k, values in cpu.items()}
    return [
        row(
            "ingress CPU per request (HAProxy + proxy process), latency log off",
            round(off * 1e6, 1),
            "µs",
            "",
            f"rounds: {rounds_text[False]} µs",
        ),
        row(
            "ingress CPU per request (HAProxy + proxy process), latency log on",
            round(on * 1e6, 1),
            "µs",
            "",
            f"{100 * (on - off) / off:+.1f} %; rounds: {rounds_text[True]} µs ({rounds} alternating rounds × "
            f"{requests:,} requests, weighted route at 25 %)",
        ),
        row(
            "  … proxy process CPU over the whole run, log on / off",
            round(proxy_only[True], 2),
            "s",
            "",
            f"off: {proxy_only[False]:.2f} s (start-up and 2-s heartbeats included)",
        ),
    ]


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_measure(quick))


def main() -> None:
    bench_main("canary weights (issue 41)", run, __doc__, "100 weight changes, 4 CPU rounds of 10,000 requests")


if __name__ == "__main__":
    main()
