"""How long an old release stays up after a promotion under a steady load (issue 42, "a drain that ends
when the work does"): before, always the whole drain window (600 s).

Run: ``python -m benchmarks.drain_early_bench [--full]`` (also part of ``make bench``).

In one process against an embedded nats-server: the orchestrator loop (leader lease, fenced batches, real
clock, the default drain window of 600 s and quiet period ``ZATTERA_DRAIN_QUIET``) with its live view of
the proxies' heartbeats; an instant agent (tests/agent_sim.py); a real proxy (the Python data path, its
production heartbeat interval of 2 s) in front of two upstreams answering after 20 ms; a steady load of
8 clients sending requests back to back through the proxy all along; and a route follower that publishes
the snapshot sending the env's traffic to the active release's upstream as soon as a promotion is seen,
its version the env's revision (as the route builder's snapshot versions are state revisions).

Figure: from the promotion write (``promoted_at``) to the write that stops the old release, per deploy,
median and max over 5 deploys (``--full``: 20). Every request must succeed throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, row
from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers
from services.proxy.server import Proxy
from shared import keys as K
from shared.clock import RealClock, from_timestamp
from shared.connection import connect
from shared.deploy import Deployer
from shared.lease import run_while_leading
from shared.live import LiveView
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent_sim import AgentSim
from tests.proxy.harness import Routes, endpoint, http_route, settings

PH = pb.DeploymentPhase
ENV = "bench-drain-env"
HOST = "drain.bench.example.com"
CLIENTS = 8
UPSTREAM_DELAY = 0.02
TIMERS = Timers()


async def _upstream(name: str) -> tuple[str, web.AppRunner]:
    async def handle(_: web.Request) -> web.Response:
        await asyncio.sleep(UPSTREAM_DELAY)
        return web.Response(text=name)

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"127.0.0.1:{runner.addresses[0][1]}", runner


async def _seed(writer: Writer) -> None:
    txn = writer.txn("bench-seed")
    for i in range(2):
        n = pb.Node(status=pb.NODE_STATUS_ALIVE, schedulable=True, os_arch="linux/amd64")
        n.meta.id = f"node-{i}"
        n.capacity.cpu_millis = 64_000
        n.capacity.memory_mb = 262_144
        n.roles.append(pb.NODE_ROLE_WORKER)
        txn.put(n)
    env = pb.Environment(project_id="p1", app_id="a1", name="production")
    env.meta.id = ENV
    env.service.replicas.min = 2
    txn.put(env)
    await writer.commit(txn)


async def _follow_routes(view: StateView, routes: Routes, upstreams: list[str]) -> None:
    """Publish the route to the active release's upstream whenever the active release changes."""
    served = ""
    while True:
        env = view.env(ENV)
        if env is not None and env.active_release_id and env.active_release_id != served:
            release = view.release(env.active_release_id)
            version = release.version if release is not None else 0
            addr = upstreams[version % 2]
            routes.version = max(routes.version, view.rev(K.env(ENV)) - 1)  # snapshot version = env revision
            await routes.publish(http_route(HOST, ENV, [endpoint(addr, f"a-{env.active_release_id}")]))
            served = env.active_release_id
        await asyncio.sleep(0.01)


async def _load(port: int, stop: asyncio.Event, failures: list[int], count: list[int]) -> None:
    async with aiohttp.ClientSession() as client:
        while not stop.is_set():
            async with client.get(f"http://127.0.0.1:{port}/", headers={"Host": HOST}) as response:
                await response.read()
                count[0] += 1
                if response.status != 200:
                    failures.append(response.status)


async def _measure(quick: bool) -> list[Row]:
    deploys = 5 if quick else 20
    lifetimes: list[float] = []
    failures: list[int] = []
    count = [0]
    upstreams = [await _upstream("even"), await _upstream("odd")]
    with embedded_server() as server, tempfile.TemporaryDirectory() as tmp:
        conn = await connect(server.url, name="bench")
        await provision(conn.js)
        view = StateView(conn, name="bench-observer")
        await view.start()
        writer = Writer(conn, view)
        await _seed(writer)
        clock = RealClock()
        live = LiveView(conn, clock)
        await live.start()
        orch_view = StateView(conn, name="bench-orchestrator")
        await orch_view.start()
        orchestrator = Orchestrator(LoopDeps(conn, orch_view, clock), timers=TIMERS, tick=15.0, live=live)
        leader = asyncio.create_task(
            run_while_leading(conn, "orchestrator", orchestrator.run, holder="bench", ttl=3, renew_interval=1)
        )
        agent = await AgentSim(conn, name="bench-agent").start()
        proxy = Proxy(settings(heartbeat_interval=2.0), nats_url=server.url, cache_dir=Path(tmp))
        await proxy.start()
        await asyncio.wait_for(proxy.wait_connected(), 10)
        routes = Routes(conn)
        addrs = [addr for addr, _ in upstreams]
        background = [asyncio.create_task(_follow_routes(view, routes, addrs))]
        deployer = Deployer(writer)
        stop = asyncio.Event()
        load: list[asyncio.Task[None]] = []
        try:
            for i in range(deploys + 1):
                created = await deployer.deploy_image(ENV, f"app:v{i}")
                dep = created.deployment.meta.id

                def finished(dep: str = dep) -> bool:
                    d = view.deployment(dep)
                    return d is not None and d.phase in (PH.DEPLOYMENT_PHASE_SUCCEEDED, PH.DEPLOYMENT_PHASE_FAILED)

                deadline = time.monotonic() + TIMERS.drain_window + 60
                while not finished():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"deploy {i} did not finish")
                    await asyncio.sleep(0.05)
                d = view.deployment(dep)
                assert d is not None and d.phase == PH.DEPLOYMENT_PHASE_SUCCEEDED, d
                if i == 0:  # the first deploy has nothing to drain: start the load on its release
                    await asyncio.sleep(0.5)
                    load = [asyncio.create_task(_load(proxy.port, stop, failures, count)) for _ in range(CLIENTS)]
                    await asyncio.sleep(2.0)
                    continue
                lifetimes.append(from_timestamp(d.meta.updated_at) - from_timestamp(d.promoted_at))
        finally:
            stop.set()
            for task in load:
                with contextlib.suppress(Exception):
                    await task
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await proxy.stop()
            leader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leader
            await agent.stop()
            await live.stop()
            await orch_view.stop()
            await view.stop()
            await conn.close()
            for _, runner in upstreams:
                await runner.cleanup()
    label = f"{deploys} deploys, {CLIENTS} clients, quiet {TIMERS.drain_quiet:g} s"
    return [
        row(f"old release up after promotion, median ({label})", median(lifetimes), "s", "≪ 600 (window)"),
        row(f"old release up after promotion, max ({label})", max(lifetimes), "s"),
        row("requests failed during those deploys", float(len(failures)), f"of {count[0]:,}", "0"),
    ]


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_measure(quick))


if __name__ == "__main__":
    bench_main("Drain of the old release", run, __doc__, "20 deploys")
