"""End-to-end figures on the whole product: real processes (embedded NATS, every service, two agents, the
proxy) started by the e2e harness (``tests/e2e/cluster.py``, short ``ZATTERA_*`` timers, no tracing).

Run: ``python -m benchmarks.e2e_bench [--full] [--json]`` (also part of ``make bench``).

1. **Cold-start overhead of the control plane.** An env with ``scale_to_zero`` (idle 2 s) is cooled to
   zero; one request is sent through the proxy, which holds it and asks for activation. Measured from the
   request being sent to the first route snapshot (followed in this process on the proxies' subject, the
   way the proxy gets it) with a healthy endpoint for the env, **minus the app's own start time**: from
   its process creation (``state.json`` of the instance) to the moment it listens (the example app prints
   ``ready at <epoch>`` in its output). What remains is activation → scale write → placement → agent
   (fetch, unpack, spawn) → first health probe → observed write → route build → snapshot. 5 samples
   quick, 15 full. Target p50 ≤ 300 ms.
2. **Failed requests during consecutive red/green deploys under load.** ~60 requests/s through the proxy
   on a 2-replica env while it is redeployed from source (alternating v1/v2) 3 times quick, 10 full, each
   to SUCCEEDED with the blue replicas gone (drain window 1.5 s) before the next. Target 0.

Anchor: the reference only records the whole hold of a request (count, total, max: autoscale.md), with no
split between the app's own start and the platform's; it has no figure for failed requests under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, median, percentile, row
from shared.connection import Connection
from shared.routeclient import RouteClient
from shared.state.feed import StateView
from tests.e2e.cluster import E2ECluster, Load, app_source, env_by_name, healthy, running
from tests.waiting import eventually

COLD_ENV = """
[env.cold]
replicas = { min = 1, max = 1 }
scale_to_zero = true
idle_timeout = "2s"
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }
"""
READY = re.compile(r"ready at (\d+\.\d+)")


def _started_at(pid: int) -> float:
    """Wall-clock start of a live process to the clock tick (``/proc/<pid>/stat`` start time since boot).

    Not psutil's ``create_time()``: it adds the boot time, which Linux gives in whole seconds, so it may be
    off by up to a second against ``time.time()``.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5)
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def _instance_start(cluster: E2ECluster, a: pb.Assignment) -> float:
    """The app's own start: process creation → listening (from the instance's files)."""
    instance = cluster.root / f"agent-{a.node_id}" / "instances" / a.meta.id
    record = json.loads((instance / "state.json").read_text())
    found = READY.findall((instance / "stdout.log").read_text(errors="replace"))
    return float(found[-1]) - _started_at(int(record["pid"]))


async def _cold_starts(cluster: E2ECluster, conn: Connection, view: StateView, samples: int) -> dict[str, list[float]]:
    env = env_by_name(view, "cold")
    assert env is not None
    env_id = env.meta.id
    host = "hello-cold.localhost"
    out: dict[str, list[float]] = {"overhead": [], "app": [], "endpoint": [], "response": []}
    with tempfile.TemporaryDirectory() as tmp:
        routes = RouteClient(Path(tmp) / "routes.pb")
        await routes.start(conn)
        seen_at: dict[int, float] = {}

        async def follow() -> None:
            updates = routes.updates()
            try:
                async for snapshot in updates:
                    if any(
                        r.environment_id == env_id and any(e.healthy for e in r.endpoints) for r in snapshot.http_routes
                    ):
                        seen_at.setdefault(snapshot.version, time.monotonic())
            finally:
                updates.close()

        follower = asyncio.create_task(follow())
        try:
            for _ in range(samples):
                await eventually(
                    lambda: (
                        (e := view.env(env_id)) is not None and e.effective_replicas == 0 and not running(view, env_id)
                    ),
                    120,
                    "cooled to zero",
                )
                await eventually(
                    lambda: (
                        not any(r.environment_id == env_id and r.endpoints for r in routes.current.http_routes)
                        and cluster.proxy_routes_version() >= routes.version
                    ),
                    60,
                    "no endpoint left in the snapshot, the proxy's included",
                )
                seen_at.clear()
                sent = time.monotonic()
                status, body = await cluster.get(host, timeout=60)
                answered = time.monotonic()
                assert status == 200, body
                await eventually(lambda: bool(seen_at), 10, "endpoint snapshot seen")
                await eventually(lambda: bool(healthy(view, env_id)), 10, "the woken replica in the view")
                live = healthy(view, env_id)
                app = _instance_start(cluster, live[0])
                endpoint = min(seen_at.values()) - sent
                out["endpoint"].append(endpoint)
                out["app"].append(app)
                out["overhead"].append(endpoint - app)
                out["response"].append(answered - sent)
        finally:
            follower.cancel()
            await routes.stop()
    return out


async def _red_green(cluster: E2ECluster, view: StateView, sources: dict[str, Path], deploys: int) -> Load:
    env = env_by_name(view, "production")
    assert env is not None
    env_id = env.meta.id

    def succeeded(deployment_id: str) -> bool:
        d = view.deployment(deployment_id)
        return d is not None and d.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED

    def only(release_id: str) -> bool:
        return all(a.release_id == release_id for a in view.assignments(env_id))

    load = Load(cluster.proxy_port, "hello.localhost", rate=60).start()
    try:
        await eventually(lambda: load.ok >= 30, 30, "load is flowing")
        for i in range(deploys):
            version = "v2" if i % 2 == 0 else "v1"
            done = await cluster.acli("deploy", str(sources[version]), "--env", "demo/hello/production")
            deployment_id = next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("deployment "))
            await eventually(lambda d=deployment_id: succeeded(d), 120, "deployment succeeded")  # type: ignore[misc]
            d = view.deployment(deployment_id)
            assert d is not None
            await eventually(lambda r=d.release_id: only(r), 60, "blue removed")  # type: ignore[misc]
        served = load.ok
        await eventually(lambda: load.ok >= served + 30, 30, "serving after the last switch")
    finally:
        await load.stop()
    return load


async def _measure(quick: bool) -> list[Row]:
    samples, deploys = (5, 3) if quick else (15, 10)
    root = Path(tempfile.mkdtemp(prefix="zattera-e2e-bench-"))
    cluster = E2ECluster(root / "cluster", trace=False)
    try:
        await asyncio.to_thread(cluster.start)
        await cluster.wait_ready()
        sources = {v: app_source(root / "src" / v, v) for v in ("v1", "v2")}
        for src in sources.values():
            toml = src / "zattera.toml"
            toml.write_text(toml.read_text() + COLD_ENV)
        await cluster.acli("apps", "apply", str(sources["v1"] / "zattera.toml"))
        await cluster.acli("deploy", str(sources["v1"]), "--env", "demo/hello/production")
        await cluster.acli("deploy", str(sources["v1"]), "--env", "demo/hello/cold")
        async with cluster.state() as (conn, view):
            cold = await _cold_starts(cluster, conn, view, samples)
            load = await _red_green(cluster, view, sources, deploys)
    finally:
        await asyncio.to_thread(cluster.stop)
        shutil.rmtree(root, ignore_errors=True)
    ms = 1000.0
    anchor = "reference: records only the whole hold (count/total/max, autoscale.md), no platform/app split"
    return [
        row(
            "cold start: control-plane overhead p50 (held → endpoint in snapshot − app start)",
            median(cold["overhead"]) * ms,
            "ms",
            "≤ 300 ms",
            anchor,
        ),
        row("cold start: control-plane overhead p90", percentile(cold["overhead"], 90) * ms, "ms", "", anchor),
        row("cold start: the app's own start p50 (spawn → listening)", median(cold["app"]) * ms, "ms", "", ""),
        row("cold start: held request answered p50 (end to end)", median(cold["response"]) * ms, "ms", "", ""),
        row(
            f"red/green under load: failed requests over {deploys} deploys",
            float(len(load.failures)),
            "requests",
            "0",
            f"{load.sent} sent at {load.rate_achieved():.0f}/s",
        ),
    ]


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_measure(quick))


def main() -> None:
    bench_main("End to end", run, __doc__, "15 cold starts and 10 red/green deploys")


if __name__ == "__main__":
    main()
