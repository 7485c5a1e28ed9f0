"""The soak (``make chaos``): the whole product under CPU pressure for ``ZATTERA_SOAK_MINUTES`` (30).

Real processes (NATS, every service, two agents, HAProxy), the real CLI, and a CPU hog on every core the
test starts before the cluster and stops after. Four envs, each with its own workload, all at once:

* ``web``: red/green redeploys one after the other under a steady load: no request may fail;
* ``scaled``: its replica count changes (2 → 3 → 1 → 2 …) under a steady load (failures are counted);
* ``cold``: ``scale_to_zero``, no health check: woken by a request each time it has cooled; every wake
  must be answered 200;
* ``flood``: an app writing ~1,000 numbered lines a second: every line must reach the log stream.

Throughout, every leader loop's lease is watched (no service is killed, so any change of holder is a
spurious failover) and every deployment must end (SUCCEEDED) within a bound. The figures are printed as
one ``SOAK SUMMARY {...}`` line (``-s``) and kept in RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import pytest
from nats.aio.msg import Msg
from zattera.v1 import types_pb2 as pb

from shared.applogs import STDOUT, app_log_subject, lines_of
from shared.deployments import is_terminal
from shared.state.feed import StateView
from tests.cpuhog import cpu_hog
from tests.e2e.cluster import LOOPS, E2ECluster, Load, env_by_name
from tests.waiting import eventually

MINUTES = float(os.environ.get("ZATTERA_SOAK_MINUTES", "30"))
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(int(MINUTES * 60) + 1200)]

PROJECT = "soak"
TOML = """
project = "soak"
app = "app"

[env.web]
replicas = 2
healthcheck = { type = "http", path = "/", interval = "1s", timeout = "2s", grace_period = "20s" }

[env.scaled]
replicas = 2
healthcheck = { type = "http", path = "/", interval = "1s", timeout = "2s", grace_period = "20s" }

[env.cold]
replicas = 1
scale_to_zero = true
idle_timeout = "3s"

[env.flood]
replicas = 1
ports = []
"""
DEPLOY_BOUND = 180.0
"""Seconds a deployment may take before it counts as stuck."""


def serve(version: str) -> str:
    """busybox httpd answering ``{"version": ...}`` (as the example app does) on its port."""
    command = (
        f'D=/tmp/soak-$ZATTERA_ASSIGNMENT_ID; mkdir -p $D; echo \'{{"version": "{version}"}}\' > $D/index.html; '
        "exec busybox httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h $D"
    )
    return "exec:" + quote(command, safe="")


FLOOD = "exec:" + quote(
    'i=0; while :; do j=0; while [ $j -lt 100 ]; do echo "flood $i"; i=$((i+1)); j=$((j+1)); done; sleep 0.1; done',
    safe="",
)


class Lines:
    """Every ``flood N`` line the flood env's stream holds, followed from its start."""

    def __init__(self) -> None:
        self.numbers: set[int] = set()
        self.dropped = 0

    async def follow(self, cluster: E2ECluster, env_id: str) -> None:
        async def on_batch(msg: Msg) -> None:
            for line in lines_of(msg.data):
                if line.dropped:
                    self.dropped += line.dropped
                elif line.stream == STDOUT and line.line.startswith("flood "):
                    self.numbers.add(int(line.line.split()[1]))

        async with cluster.state() as (conn, _):
            sub = await conn.js.subscribe(app_log_subject(env_id), ordered_consumer=True, cb=on_batch)
            try:
                await asyncio.Event().wait()
            finally:
                await sub.unsubscribe()

    def gaps(self) -> list[int]:
        return sorted(set(range(max(self.numbers, default=-1) + 1)) - self.numbers)


def kinds(failures: list[str]) -> dict[str, int]:
    """Failures by what they were (``HTTP 502: …``, ``ServerDisconnectedError(…)``), without their time."""
    return dict(Counter(failure.split(" ", 1)[1][:60] for failure in failures))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_thirty_minutes_of_deploys_scaling_wakes_and_log_floods_under_cpu_pressure(tmp_path: Path) -> None:
    toml = tmp_path / "zattera.toml"
    toml.write_text(TOML)
    cluster = E2ECluster(tmp_path / "cluster", trace=False)
    summary: dict[str, object] = {"minutes": MINUTES, "cores": os.cpu_count()}
    loads: list[float] = []
    with cpu_hog():
        await asyncio.to_thread(cluster.start)
        try:
            await cluster.wait_ready(120)
            await cluster.acli("apps", "apply", str(toml))
            for env, image in (("web", serve("v1")), ("scaled", serve("s1")), ("cold", serve("c1")), ("flood", FLOOD)):
                await cluster.acli("deploy", "--image", image, "--env", f"{PROJECT}/app/{env}")
            async with cluster.state() as (_, view):
                envs = {name: env_by_name(view, name) for name in ("web", "scaled", "cold", "flood")}
                assert all(envs.values()), envs
                ids = {name: env.meta.id for name, env in envs.items() if env is not None}
                holders = {loop: view.lease(loop) for loop in LOOPS}
                assert all(holders.values()), holders
                failovers: Counter[str] = Counter()
                lines = Lines()
                follower = asyncio.create_task(lines.follow(cluster, ids["flood"]))
                # A failure is an error answer or a refused/broken connection. A slow answer is not: with every core
                # taken, a request may wait long for the CPU (the proxy's, the app's, this client's) without any
                # fault of the product; the generous timeout keeps that apart from a failed request.
                web = Load(cluster.proxy_port, "app-web.localhost", rate=20, timeout=120, max_inflight=10_000).start()
                scaled = Load(
                    cluster.proxy_port, "app-scaled.localhost", rate=10, timeout=120, max_inflight=10_000
                ).start()
                deploy_seconds: list[float] = []
                wake_seconds: list[float] = []
                wake_failures: list[str] = []
                stuck: list[str] = []
                scales = 0
                end = time.monotonic() + MINUTES * 60

                def watch_leases() -> None:
                    for loop, before in holders.items():
                        now = view.lease(loop)
                        if now is not None and before is not None and now.holder != before.holder:
                            failovers[loop] += 1
                            holders[loop] = now

                async def redeploys() -> None:
                    version = 1
                    while time.monotonic() < end:
                        version += 1
                        started = time.monotonic()
                        await cluster.acli("deploy", "--image", serve(f"v{version}"), "--env", f"{PROJECT}/app/web")
                        await eventually(lambda v=version: web.versions[f"v{v}"] > 0, DEPLOY_BOUND, f"v{version}")
                        deploy_seconds.append(time.monotonic() - started)

                async def scaling() -> None:
                    nonlocal scales
                    counts = [3, 1, 2]
                    while time.monotonic() < end:
                        await cluster.acli("scale", "--env", f"{PROJECT}/app/scaled", str(counts[scales % 3]))
                        scales += 1
                        await asyncio.sleep(60)  # the workload's pace, not a timer of the product

                async def wakes() -> None:
                    while time.monotonic() < end:
                        await eventually(
                            lambda: (e := view.env(ids["cold"])) is not None and e.effective_replicas == 0,
                            120,
                            "cold cooled",
                        )
                        started = time.monotonic()
                        try:
                            status, body = await cluster.get("app-cold.localhost", timeout=60)
                        except (OSError, TimeoutError) as exc:
                            status, body = 0, repr(exc)
                        if status == 200:
                            wake_seconds.append(time.monotonic() - started)
                        else:
                            wake_failures.append(f"{time.time():.3f} {status} {body[:200]}")

                async def observe() -> None:
                    while time.monotonic() < end:
                        watch_leases()
                        loads.append(os.getloadavg()[0])
                        for d in view.deployments():
                            age = time.time() - d.meta.created_at.seconds
                            if not is_terminal(d.phase) and age > DEPLOY_BOUND and d.meta.id not in stuck:
                                stuck.append(d.meta.id)
                        await asyncio.sleep(5)

                try:
                    await asyncio.gather(redeploys(), scaling(), wakes(), observe())
                finally:
                    await web.stop()
                    await scaled.stop()
                await eventually(
                    lambda: all(is_terminal(d.phase) for d in view.deployments()),
                    DEPLOY_BOUND,
                    "every deployment ended",
                )
                written = flood_written(cluster, view, ids["flood"])
                await eventually(
                    lambda: lines.numbers.issuperset(range(written)), 120, f"the flood's {written} lines shipped"
                )
                follower.cancel()
                failed = [d.meta.id for d in view.deployments() if d.phase != pb.DEPLOYMENT_PHASE_SUCCEEDED]
                summary.update(
                    {
                        "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                        "red_green": {
                            "deploys": len(deploy_seconds),
                            "deploy_seconds_p50": percentile(deploy_seconds, 0.5),
                            "deploy_seconds_p99": percentile(deploy_seconds, 0.99),
                            "requests": web.sent,
                            "failed": len(web.failures),
                            "failures": kinds(web.failures),
                        },
                        "scaling": {
                            "changes": scales,
                            "requests": scaled.sent,
                            "failed": len(scaled.failures),
                            "failures": kinds(scaled.failures),
                        },
                        "wakes": {
                            "answered": len(wake_seconds),
                            "failed": len(wake_failures),
                            "seconds_p50": percentile(wake_seconds, 0.5),
                            "seconds_p99": percentile(wake_seconds, 0.99),
                        },
                        "logs": {
                            "written": written,
                            "shipped": len(lines.numbers),
                            "lost": len(lines.gaps()),
                            "dropped": lines.dropped,
                        },
                        "failovers": dict(failovers),
                        "stuck_deployments": stuck,
                        "failed_deployments": failed,
                    }
                )
                print("SOAK SUMMARY " + json.dumps(summary, default=str))
                (tmp_path / "soak-summary.json").write_text(json.dumps(summary, indent=2, default=str))
                assert web.failures == [], web.summary()
                assert wake_failures == [], wake_failures[:10]
                assert lines.gaps() == [] and lines.dropped == 0, (lines.gaps()[:20], lines.dropped)
                assert not failovers, dict(failovers)
                assert stuck == [] and failed == [], (stuck, failed)
                assert len(deploy_seconds) >= 3 and len(wake_seconds) >= 3, summary
        finally:
            await asyncio.to_thread(cluster.stop)


def flood_written(cluster: E2ECluster, view: StateView, env_id: str) -> int:
    """How many lines the flood's instance has written so far: its output file's last complete line names the
    newest number (the shipped part of the file is given back to the file system: its start reads as zeros)."""
    instances = [a for a in view.assignments(env_id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN]
    assert len(instances) == 1, instances
    output = cluster.root / f"agent-{instances[0].node_id}" / "instances" / instances[0].meta.id / "stdout.log"
    with output.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - 4096))
        complete = fh.read().rsplit(b"\n", 2)
    last = complete[-2] if len(complete) >= 2 else b""
    return int(last.split()[1]) + 1 if last.startswith(b"flood ") else 0
