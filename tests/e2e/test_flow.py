"""The product, end to end: real processes (NATS, every service, two agents, the proxy) and the real CLI.

The tests of this module share one cluster and run in order: deploy v1 from source, red/green to v2
under load, roll back, follow the deploy's trace, then scale-to-zero and autoscaling on other envs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from tests.e2e.cluster import (
    E2ECluster,
    Load,
    app_source,
    env_by_name,
    healthy,
    route_snapshot,
    running,
    spans_of_trace,
    version_of,
)
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROD = "demo/hello/production"
PROD_HOST = "hello.localhost"
EXTRA_ENVS = """
[env.idle]
replicas = { min = 1, max = 1 }
scale_to_zero = true
idle_timeout = "3s"
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }

[env.auto]
replicas = { min = 1, max = 3 }
autoscale = { target_rps_per_replica = 5 }
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    out = {v: app_source(root / v, v) for v in ("v1", "v2")}
    for src in out.values():
        with open(src / "zattera.toml", "a") as fh:
            fh.write(EXTRA_ENVS)
    return out


def deployment_id_of(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("deployment ") and " created" in line:
            return line.split()[1]
        if line.startswith("rollback ") and " created" in line:
            return line.split()[1]
    raise AssertionError(f"no deployment id in the CLI output:\n{stderr}")


async def test_deploy_from_source_is_served_through_the_proxy(cluster: E2ECluster, sources: dict[str, Path]) -> None:
    applied = await cluster.acli("apps", "apply", str(sources["v1"] / "zattera.toml"))
    assert "env demo/hello/production" in applied.stdout

    deployed = await cluster.acli("deploy", str(sources["v1"]), "--env", PROD)
    assert "live: release" in deployed.stderr, deployed.stderr
    deployment_id = deployment_id_of(deployed.stderr)
    async with cluster.state() as (_, view):
        d = view.deployment(deployment_id)
        assert d is not None
        build = view.build(d.build_id)
        assert build is not None and build.status == pb.BUILD_STATUS_SUCCEEDED and build.node_id == "n1"
        env = view.env(d.environment_id)
        assert env is not None and env.active_release_id == d.release_id  # promoted
        release = view.release(d.release_id)
        assert release is not None and release.image_ref  # built and stamped
        live = healthy(view, env.meta.id, d.release_id)
        assert len(live) == 2, [(a.node_id, a.observed.state) for a in running(view, env.meta.id)]

    async def served() -> bool:
        status, body = await cluster.get(PROD_HOST)
        return status == 200 and version_of(body) == "v1"

    await eventually(served, 30, "v1 answers through the proxy")
    status, body = await cluster.get("hello-production.localhost")  # the implicit route too
    assert status == 200 and '"hello": "world"' in body

    ps = await cluster.acli("ps", "--env", PROD, "--json")
    assert ps.stdout.count('"HEALTHY"') + ps.stdout.count("INSTANCE_STATE_HEALTHY") >= 2, ps.stdout

    async def both_replicas_logged() -> bool:
        logs = await cluster.acli("logs", "--env", PROD, "--json")
        started = [json.loads(line) for line in logs.stdout.splitlines() if "listening on" in line]
        return {doc["instance"] for doc in started} == {a.meta.id for a in live}

    await eventually(both_replicas_logged, 30, "zattera logs shows both replicas starting")


async def test_red_green_redeploy_under_load_fails_no_request(cluster: E2ECluster, sources: dict[str, Path]) -> None:
    load = Load(cluster.proxy_port, PROD_HOST, rate=60).start()
    try:
        await eventually(lambda: load.ok >= 30, 30, "load is flowing")
        deployed = await cluster.acli("deploy", str(sources["v2"]), "--env", PROD)
        deployment_id = deployment_id_of(deployed.stderr)
        async with cluster.state() as (_, view):
            d = view.deployment(deployment_id)
            assert d is not None
            env_id = d.environment_id
            # Past the switch: the deployment SUCCEEDED (drain window over) and blue is gone.
            await eventually(
                lambda: (x := view.deployment(deployment_id)) is not None and x.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED,
                60,
                "the deployment succeeded",
            )
            await eventually(
                lambda: all(a.release_id == d.release_id for a in view.assignments(env_id)),
                60,
                "blue replicas removed",
            )
        seen_v2 = load.versions["v2"]
        await eventually(lambda: load.versions["v2"] >= seen_v2 + 30, 30, "v2 keeps serving after blue is gone")
    finally:
        await load.stop()
    assert load.rate_achieved() >= 50, load.summary()
    assert load.versions["v1"] > 0 and load.versions["v2"] > 0, load.summary()
    assert load.failures == [], load.summary()


async def test_rollback_returns_to_the_previous_release(cluster: E2ECluster, sources: dict[str, Path]) -> None:
    load = Load(cluster.proxy_port, PROD_HOST, rate=50).start()
    try:
        done = await cluster.acli("rollback", "--env", PROD)
        assert "live: release" in done.stderr, done.stderr

        async def back_to_v1() -> bool:
            status, body = await cluster.get(PROD_HOST)
            return status == 200 and version_of(body) == "v1"

        await eventually(back_to_v1, 30, "v1 serves again")
        async with cluster.state() as (_, view):
            env = env_by_name(view, "production")
            assert env is not None
            active = view.release(env.active_release_id)
            assert active is not None and active.version == 1
    finally:
        await load.stop()
    assert load.failures == [], load.summary()


async def test_one_trace_follows_the_deploy_across_services(cluster: E2ECluster) -> None:
    async with cluster.state() as (_, view):
        first = view.deployments()[0]

    def trace_services() -> set[str]:
        spans = cluster.spans()
        roots = [s for s in spans if s["name"] == "cli.deploy" and s["attributes"].get("deployment") == first.meta.id]
        if not roots:
            return set()
        return {s["service"] for s in spans_of_trace(spans, roots[0]["trace_id"])}

    wanted = {"zattera-cli", "zattera-orchestrator", "zattera-scheduler", "zattera-agent", "zattera-builds"}
    await eventually(lambda: wanted <= trace_services(), 30, f"one trace with spans of {sorted(wanted)}")
    spans = cluster.spans()
    root = next(s for s in spans if s["name"] == "cli.deploy" and s["attributes"].get("deployment") == first.meta.id)
    names = {s["name"] for s in spans_of_trace(spans, root["trace_id"])}
    assert {"orchestrator.reconcile", "agent.instance.start", "agent.build", "scheduler.pass"} <= names, names


async def test_scale_to_zero_after_idle_and_wake_on_request(cluster: E2ECluster, sources: dict[str, Path]) -> None:
    host = "hello-idle.localhost"
    await cluster.acli("deploy", str(sources["v1"]), "--env", "demo/hello/idle")
    status, _ = await cluster.get(host)
    assert status == 200
    async with cluster.state() as (conn, view):
        env = env_by_name(view, "idle")
        assert env is not None
        env_id = env.meta.id
        await eventually(
            lambda: (e := view.env(env_id)) is not None and e.effective_replicas == 0 and not running(view, env_id),
            60,
            "cooled to zero after the idle window",
        )

        seen: list[str] = []

        async def no_endpoint() -> bool:
            snapshot = await route_snapshot(conn)
            routes = [r for r in (snapshot.http_routes if snapshot else []) if r.environment_id == env_id]
            seen[:] = [
                f"{snapshot.version if snapshot else None}: {[(r.hostname, len(r.endpoints)) for r in routes]}",
                f"proxy at version {cluster.proxy_routes_version()}",
            ]
            if snapshot is not None and routes and all(not r.endpoints for r in routes):
                # ... and the proxy has it too: else the request may still reach the instance being stopped.
                return cluster.proxy_routes_version() >= snapshot.version
            return False

        try:
            await eventually(no_endpoint, 30, "the route has no endpoint left")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {seen}") from None
        status, body = await cluster.get(host, timeout=40)  # held, activated, then forwarded
        assert status == 200, body
        assert version_of(body) == "v1"
        await eventually(
            lambda: (e := view.env(env_id)) is not None and e.effective_replicas >= 1, 10, "woken: replicas back"
        )


async def test_autoscale_up_under_load(cluster: E2ECluster, sources: dict[str, Path]) -> None:
    host = "hello-auto.localhost"
    await cluster.acli("deploy", str(sources["v1"]), "--env", "demo/hello/auto")
    load = Load(cluster.proxy_port, host, rate=40).start()
    try:
        async with cluster.state() as (_, view):
            env = env_by_name(view, "auto")
            assert env is not None
            env_id = env.meta.id
            await eventually(
                lambda: (e := view.env(env_id)) is not None and e.effective_replicas >= 2,
                60,
                "the autoscaler raised the replica count",
            )
            await eventually(lambda: len(healthy(view, env_id)) >= 2, 60, "the new replicas are healthy")
    finally:
        await load.stop()
    assert load.failures == [], load.summary()
