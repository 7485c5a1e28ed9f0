"""Canary releases on a real cluster (issue 41): the services as processes, agents running the app, the
HAProxy proxy applying the weights at run time and reporting per-release counters, the orchestrator judging
each step — under a steady load through the proxy.

* a good release goes through every step and is promoted, no request failing;
* a release answering 500 to one request in ten is aborted at its first step, and fewer requests failed
  than the canary's share of what was sent meanwhile;
* the orchestrator killed mid-step: the new one resumes at the same step, with the same weights;
* the proxy restarted mid-step: it serves the same weights again.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.proxy.haproxy_config import Layout
from services.proxy.haproxy_runtime import RuntimeAPIError, command, parse_stat_csv
from tests.e2e.cluster import E2ECluster, Load, route_snapshot
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

PROD = "demo/canary/production"
HOST = "canary.localhost"
STEPS = (10, 50, 100)

APP = """
import json, os, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "{version}"
FAIL_EVERY = {fail_every}
lock, served = threading.Lock(), [0]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/healthz":
            status, body = 200, b"ok"
        else:
            with lock:
                served[0] += 1
                n = served[0]
            status = 500 if FAIL_EVERY and n % FAIL_EVERY == 0 else 200
            body = json.dumps({{"version": VERSION}}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        return


bind = os.environ.get("ZATTERA_BIND_ADDR", "127.0.0.1")
ThreadingHTTPServer((bind, int(os.environ["PORT"])), Handler).serve_forever()
"""

TOML = """
project = "demo"
app = "canary"

[run]
command = "python3 app.py"

[env.production]
replicas = 2
resources = {{ cpu_millis = 100, memory_mb = 64 }}
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
domains = ["{host}"]
strategy = "canary"

[env.production.canary]
steps = {steps}
pause = "{pause}"
max_error_ratio = 0.03
max_latency_ratio = 3
min_requests = {min_requests}
"""


def source(dest: Path, version: str, *, fail_every: int = 0, pause: str = "2s", min_requests: int = 30) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "app.py").write_text(APP.format(version=version, fail_every=fail_every))
    (dest / "zattera.toml").write_text(
        TOML.format(host=HOST, steps=list(STEPS), pause=pause, min_requests=min_requests)
    )
    return dest


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    root: Path = tmp_path_factory.mktemp("e2e-canary")
    c = E2ECluster(root)
    try:
        c.start()
        try:
            asyncio.run(c.wait_ready())
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the e2e cluster did not come up: {exc!r}\n{c.log_tail()}") from None
        yield c
    finally:
        c.stop()


async def deploy(cluster: E2ECluster, path: Path, *, check: bool = True) -> tuple[str, str]:
    """(deployment id, what ``zattera deploy`` printed while it watched the deployment)."""
    done = await cluster.acli("deploy", str(path), "--env", PROD, check=check)
    found = re.search(r"^deployment (\S+) created", done.stderr, re.MULTILINE)
    assert found, done.stderr
    return found.group(1), done.stderr


async def first_release(cluster: E2ECluster, tmp_path: Path) -> None:
    v1 = source(tmp_path / "v1", "v1")
    await cluster.acli("apps", "apply", str(v1 / "zattera.toml"))
    await deploy(cluster, v1)


async def wait_phase(
    cluster: E2ECluster, deployment_id: str, phases: set[int], timeout: float, what: str
) -> pb.Deployment:
    async with cluster.state() as (_, view):

        def reached() -> bool:
            d = view.deployment(deployment_id)
            return d is not None and d.phase in phases

        await eventually(reached, timeout, what)
        d = view.deployment(deployment_id)
        assert d is not None
        return d


async def test_a_good_canary_goes_through_every_step_under_load_and_is_promoted(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    await first_release(cluster, tmp_path)
    load = Load(cluster.proxy_port, HOST, rate=60).start()
    try:
        await eventually(lambda: load.ok >= 30, 30, "load is flowing")
        deployment_id, watched = await deploy(cluster, source(tmp_path / "v2", "v2"))
        d = await wait_phase(cluster, deployment_id, {pb.DEPLOYMENT_PHASE_SUCCEEDED}, 60, "the canary succeeded")
        async with cluster.state() as (_, view):
            env = view.env(d.environment_id)
            assert env is not None and env.active_release_id == d.release_id
        # `zattera deploy` watched it: each step with its weights and live figures against the bounds.
        assert "canary step 1/3: new 10% / stable 90%" in watched, watched
        assert "canary step 2/3: new 50% / stable 50%" in watched, watched
        assert "(max 3.00%)" in watched, watched
        # The last step's analysis, as written on the deployment: HAProxy's request log gave a real p99.
        assert re.search(r", p99 \d+ ms vs stable \d+ ms", d.canary.figures), d.canary.figures
        seen = load.versions["v2"]
        await eventually(lambda: load.versions["v2"] >= seen + 30, 30, "v2 serves every request")
    finally:
        await load.stop()
    assert load.failures == [], load.summary()
    assert load.versions["v1"] > 0 and load.versions["v2"] > 0, load.summary()
    events = await cluster.acli("events", "--kind", "deployment", "--json")
    assert events.stdout.count("deployment.canary_step") >= 2, events.stdout[-2000:]


async def test_a_release_failing_one_request_in_ten_is_aborted_at_its_first_step(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    load = Load(cluster.proxy_port, HOST, rate=60).start()
    try:
        await eventually(lambda: load.ok >= 30, 30, "load is flowing")
        sent_before = load.sent
        deployment_id, _ = await deploy(cluster, source(tmp_path / "v3", "v3", fail_every=10), check=False)
        d = await wait_phase(
            cluster, deployment_id, {pb.DEPLOYMENT_PHASE_FAILED, pb.DEPLOYMENT_PHASE_SUCCEEDED}, 60, "aborted"
        )
        sent_during = load.sent - sent_before
        failed = len(load.failures)
        assert d.phase == pb.DEPLOYMENT_PHASE_FAILED, d
        assert d.error.startswith("canary aborted at step 0 (10%): 5xx ratio"), d.error
        async with cluster.state() as (conn, view):
            assert not [a for a in view.assignments(d.environment_id) if a.deployment_id == deployment_id]

            async def unweighted() -> bool:
                snapshot = await route_snapshot(conn)
                routes = [r for r in snapshot.http_routes if r.hostname == HOST] if snapshot else []
                return bool(routes) and all(not e.step_tag for r in routes for e in r.endpoints)

            await eventually(unweighted, 30, "the routes carry no weight any more")
    finally:
        await load.stop()
    assert 0 < failed <= 0.10 * sent_during + 2, (failed, sent_during, load.summary())
    events = await cluster.acli("events", "--kind", "deployment.canary_aborted", "--json")
    assert "max_error_ratio" in events.stdout and deployment_id in events.stdout, events.stdout[-2000:]


async def haproxy_pid(cluster: E2ECluster) -> int:
    """The pid of the HAProxy serving the cluster's proxy (from its stats socket)."""
    info = await command(Layout(cluster.root / "proxy" / "haproxy", "", "", 0.0, 0.0).stats_socket, "show info")
    found = re.search(r"^Pid: (\d+)$", info, re.MULTILINE)
    assert found, info
    return int(found.group(1))


async def share_of(cluster: E2ECluster, version: str, requests: int, bounds: tuple[float, float]) -> None:
    """The share of ``requests`` requests (no cookie kept: each one drawn afresh) ``version`` answered is
    within ``bounds``; else HAProxy's own per-server counts are in the message."""
    load = Load(cluster.proxy_port, HOST, rate=200).start()
    try:
        await eventually(lambda: load.sent >= requests, 60, f"{requests} requests answered")
    finally:
        await load.stop()
    assert load.failures == [], load.summary()
    share = load.versions[version] / max(load.ok, 1)
    if not bounds[0] <= share <= bounds[1]:
        socket = Layout(cluster.root / "proxy" / "haproxy", "", "", 0.0, 0.0).stats_socket
        rows = parse_stat_csv(await command(socket, "show stat -1 4 -1"))
        servers = [(r["pxname"], r["svname"], r["weight"], r["stot"]) for r in rows]
        raise AssertionError(f"share {share:.3f} of {version} not in {bounds}: {load.summary()}\n{servers}")


async def test_an_orchestrator_kill_and_a_proxy_restart_mid_step_keep_the_step_and_its_weights(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    # min_requests out of reach: the canary stays at its first step until an operator decides.
    slow = source(tmp_path / "v4", "v4", min_requests=10_000_000)
    await cluster.acli("apps", "apply", str(slow / "zattera.toml"))  # the env's canary settings
    deployment_id, _ = await deploy_no_watch(cluster, slow)
    before = await wait_phase(cluster, deployment_id, {pb.DEPLOYMENT_PHASE_CANARY}, 60, "the canary started")
    assert (before.canary.step, before.canary.weight) == (0, 10)
    await share_of(cluster, "v4", 600, (0.04, 0.18))

    old_haproxy = await haproxy_pid(cluster)
    cluster.kill("orchestrator")
    cluster.kill("proxy")
    cluster.killed.discard("proxy")  # the harness starts it again

    async def restarted() -> bool:
        """The restarted proxy's HAProxy worker answers: the killed proxy's HAProxy, adopted and reloaded (its
        worker of before the reload may answer for a moment as it stops)."""
        try:
            return await haproxy_pid(cluster) != old_haproxy and await cluster._proxy_answers()
        except (OSError, TimeoutError, RuntimeAPIError, AssertionError):
            return False

    await eventually(restarted, 60, "the restarted proxy's HAProxy answers")
    await share_of(cluster, "v4", 600, (0.04, 0.18))  # the restarted proxy applies the same weights

    async with cluster.state() as (_, view):
        lease = view.lease("orchestrator")
        term = lease.term if lease is not None else 0
        cluster.killed.discard("orchestrator")

        def new_term() -> bool:
            current = view.lease("orchestrator")
            return current is not None and current.term > term

        await eventually(new_term, 60, "a new orchestrator leads")
        d = view.deployment(deployment_id)
        assert d is not None and d.phase == pb.DEPLOYMENT_PHASE_CANARY
        assert (d.canary.step, d.canary.weight, d.canary.step_started_at) == (0, 10, before.canary.step_started_at)

    asked = await cluster.acli("deploy", "abort", deployment_id)
    assert "abort requested at canary step 1 (10%)" in asked.stderr, asked.stderr
    d = await wait_phase(cluster, deployment_id, {pb.DEPLOYMENT_PHASE_FAILED}, 60, "the operator's abort")
    assert "aborted by operator" in d.error, d.error
    await share_of(cluster, "v4", 200, (0.0, 0.0))

    promoted_id, _ = await deploy_no_watch(cluster, source(tmp_path / "v5", "v5", min_requests=10_000_000))
    await wait_phase(cluster, promoted_id, {pb.DEPLOYMENT_PHASE_CANARY}, 60, "the next canary started")
    await cluster.acli("deploy", "promote", promoted_id, "--json")
    await wait_phase(cluster, promoted_id, {pb.DEPLOYMENT_PHASE_SUCCEEDED}, 60, "the operator's promote")
    await share_of(cluster, "v5", 200, (1.0, 1.0))


async def deploy_no_watch(cluster: E2ECluster, path: Path) -> tuple[str, str]:
    done = await cluster.acli("deploy", str(path), "--env", PROD, "--no-watch")
    found = re.search(r"^deployment (\S+) created", done.stderr, re.MULTILINE)
    assert found, done.stderr
    return found.group(1), done.stderr
