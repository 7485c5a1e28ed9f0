"""The operator's first hour, end to end, against real processes and the real CLI.

This module has a cluster of its own: two agents on one machine (n1 on 127.0.0.1, n2 with mesh address
127.0.0.2) and the production drain window of 600 s, so a test passes only if nothing waits on it (kept
whole: a quiet period as long as the window turns off the early end of a drain, issue 42). The
tests run in order: a first deploy finishes at promotion and is "live" only once the proxy serves it;
replicas on both nodes answer; a redeploy keeps blue warm without locking scaling out; a scale-to-zero
env cools after a deploy (its warm blue too); status; delete.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from tests.e2e.cluster import E2ECluster, Load, app_source, env_by_name, healthy, route_snapshot, running, version_of
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROD = "demo/hello/production"
IDLE = "demo/hello/idle"
HOST = "hello.localhost"
IDLE_HOST = "hello-idle.localhost"
IDLE_TIMEOUT = 3.0
TICK = 1.0  # ZATTERA_LOOP_TICK in the harness
EXTRA_ENVS = f"""
[env.idle]
replicas = {{ min = 1, max = 1 }}
scale_to_zero = true
idle_timeout = "{IDLE_TIMEOUT:g}s"
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    root: Path = tmp_path_factory.mktemp("e2e-operator")
    c = E2ECluster(
        root, mesh_ips={"n2": "127.0.0.2"}, timers={"ZATTERA_DRAIN_WINDOW": "600", "ZATTERA_DRAIN_QUIET": "600"}
    )
    try:
        c.start()
        try:
            asyncio.run(c.wait_ready())
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the e2e cluster did not come up: {exc!r}\n{c.log_tail()}") from None
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    out = {v: app_source(root / v, v) for v in ("v1", "v2")}
    for src in out.values():
        with open(src / "zattera.toml", "a") as fh:
            fh.write(EXTRA_ENVS)
    return out


def deployment_id_of(stderr: str) -> str:
    found = re.search(r"^deployment (\S+) created", stderr, re.MULTILINE)
    assert found, stderr
    return found.group(1)


def phase(view_deployment: pb.Deployment | None) -> str:
    return pb.DeploymentPhase.Name(view_deployment.phase) if view_deployment else "missing"  # type: ignore[arg-type]


async def test_a_first_deploy_finishes_at_promotion_and_is_live_once_the_proxy_serves_it(
    cluster: E2ECluster, sources: dict[str, Path]
) -> None:
    await cluster.acli("apps", "apply", str(sources["v1"] / "zattera.toml"))
    deployed = await cluster.acli("deploy", str(sources["v1"]), "--env", PROD)
    live = r"live: release v1 serves traffic \(served by 1 proxy\(ies\) at route version \d+\)"
    assert re.search(live, deployed.stderr), deployed.stderr
    # Right after "live", without waiting: the proxy answers with the new release (it holds its routes).
    status, body = await cluster.get(HOST)
    assert (status, version_of(body)) == (200, "v1"), body
    async with cluster.state() as (_, view):
        d = view.deployment(deployment_id_of(deployed.stderr))
        assert d is not None
        # Nothing to drain: SUCCEEDED at promotion, not 600 s later.
        assert d.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED and not d.HasField("drain_deadline"), phase(d)


async def test_requests_through_the_proxy_are_answered_by_replicas_on_both_nodes(cluster: E2ECluster) -> None:
    async with cluster.state() as (_, view):
        env = env_by_name(view, "production")
        assert env is not None
        await eventually(lambda: len(healthy(view, env.meta.id)) == 2, 60, "two healthy replicas")
        assert sorted(a.node_id for a in healthy(view, env.meta.id)) == ["n1", "n2"]  # spread over both
    snapshot_routes = await _routes_of(cluster, env.meta.id)
    assert {addr.split(":")[0] for addr in snapshot_routes} == {"127.0.0.1", "127.0.0.2"}, snapshot_routes

    answered: set[str] = set()

    async def both_nodes_answer() -> bool:
        # Concurrent requests: the proxy prefers its own node (n1) only on a tie of in-flight counts.
        for status, body in await asyncio.gather(*(cluster.get(HOST) for _ in range(8))):
            assert status == 200, body
            answered.add(json.loads(body)["node"])
        return answered == {"n1", "n2"}

    await eventually(both_nodes_answer, 30, "answers from the replicas on n1 and on n2 (127.0.0.2)")


async def _routes_of(cluster: E2ECluster, env_id: str) -> list[str]:
    async with cluster.state() as (conn, _):
        snapshot = await route_snapshot(conn)
    assert snapshot is not None
    routes = [r for r in snapshot.http_routes if r.environment_id == env_id and r.hostname == HOST]
    return [e.addr for r in routes for e in r.endpoints]


async def test_a_redeploy_keeps_blue_warm_fails_no_request_and_scaling_proceeds(
    cluster: E2ECluster, sources: dict[str, Path]
) -> None:
    load = Load(cluster.proxy_port, HOST, rate=40).start()
    try:
        await eventually(lambda: load.ok >= 20, 30, "load is flowing")
        deployed = await cluster.acli("deploy", str(sources["v2"]), "--env", PROD)
        assert "live: release v2 serves traffic" in deployed.stderr, deployed.stderr
        deployment_id = deployment_id_of(deployed.stderr)
        async with cluster.state() as (_, view):
            d = view.deployment(deployment_id)
            assert d is not None and d.phase == pb.DEPLOYMENT_PHASE_DRAINING_OLD, phase(d)
            env_id = d.environment_id
            scaled = await cluster.acli("scale", "--env", PROD, "3")
            assert "scaled demo/hello/production to 3 replica(s)" in scaled.stderr
            await eventually(lambda: len(healthy(view, env_id, d.release_id)) == 3, 60, "3 green replicas")
            blue = [a for a in running(view, env_id) if a.release_id == d.previous_release_id]
            assert len(blue) == 2, "blue is still kept warm"
            assert phase(view.deployment(deployment_id)) == "DEPLOYMENT_PHASE_DRAINING_OLD"
        seen = load.versions["v2"]
        await eventually(lambda: load.versions["v2"] >= seen + 20, 30, "v2 serves")
    finally:
        await load.stop()
    assert load.failures == [], load.summary()
    assert load.versions["v1"] > 0 and load.versions["v2"] > 0, load.summary()


async def test_a_scale_to_zero_env_cools_after_a_deploy_within_idle_timeout_and_a_tick(
    cluster: E2ECluster, sources: dict[str, Path]
) -> None:
    first = await cluster.acli("deploy", str(sources["v1"]), "--env", IDLE)
    assert "live: release v1" in first.stderr, first.stderr
    # Requests while v2 is deployed keep the env warm however long the deploy takes on a loaded machine (a
    # deploy outlasting the 3 s idle timeout would find the env cooled and promote with nothing to drain).
    load = Load(cluster.proxy_port, IDLE_HOST, rate=5).start()
    try:
        second = await cluster.acli("deploy", str(sources["v2"]), "--env", IDLE)
    finally:
        await load.stop()
    assert load.failures == [] and load.ok > 0, load.summary()
    promoted = load.stopped_at  # the last request: the idle timeout counts from it
    deployment_id = deployment_id_of(second.stderr)
    # v1 kept warm: the deploy saw its deployment in the drain window (what the CLI watched; a view opened
    # now may come after the 3 s idle timeout has cooled the env, which ends the drain too).
    assert "DRAINING_OLD" in second.stderr, second.stderr
    async with cluster.state() as (_, view):
        env = env_by_name(view, "idle")
        assert env is not None
        env_id = env.meta.id
        assert view.deployment(deployment_id) is not None
        await eventually(
            lambda: (e := view.env(env_id)) is not None and e.effective_replicas == 0, 60, "cooled to zero"
        )
        cooled_after = time.monotonic() - promoted
        # The fake-clock test (tests/autoscale) pins idle + one tick exactly; here real processes on a shared
        # machine add scheduling noise, but nothing waits on the 600 s drain window.
        assert cooled_after < IDLE_TIMEOUT + TICK + 20, cooled_after
        await eventually(lambda: not running(view, env_id), 30, "green and the warm blue stopped")
        assert phase(view.deployment(deployment_id)) == "DEPLOYMENT_PHASE_SUCCEEDED"
    rows = {r["env"]: r for r in json.loads((await cluster.acli("status", "--json")).stdout)}
    assert (rows[IDLE]["state"], rows[IDLE]["desired"], rows[IDLE]["active_release"]) == ("cold", 0, "v2")


async def test_status_shows_urls_release_replicas_and_the_last_deploy(cluster: E2ECluster) -> None:
    async def prod_row() -> dict[str, object]:
        rows = json.loads((await cluster.acli("status", "--json", "--env", PROD)).stdout)
        assert len(rows) == 1
        return dict(rows[0])

    async def settled() -> bool:
        row = await prod_row()
        return (row["desired"], row["running"], row["healthy"]) == (3, 3, 3)

    await eventually(settled, 60, "3 desired, running and healthy")
    row = await prod_row()
    assert row["kept_warm"] == 2  # v1, in its drain window
    port = cluster.proxy_port  # the URL that works: the proxy's port, as it is not 80
    assert f"http://{HOST}:{port}" in row["urls"] and f"http://hello-production.localhost:{port}" in row["urls"]
    assert (row["active_release"], row["state"]) == ("v2", "warm")
    assert row["last_deploy"]["release"] == "v2"  # type: ignore[index]
    table = await cluster.acli("status")
    assert "demo/hello/production" in table.stdout and "warm" in table.stdout


async def test_delete_refuses_without_yes_then_leaves_no_replica_route_or_domain(cluster: E2ECluster) -> None:
    refused = await cluster.acli("apps", "delete", "demo/hello", check=False)
    assert refused.returncode == 2 and "pass --yes" in refused.stderr, refused.stderr
    async with cluster.state() as (conn, view):
        env_ids = {e.meta.id for e in view.envs()}
        assert env_ids
        done = await cluster.acli("apps", "delete", "demo/hello", "--yes")
        assert "deleted app demo/hello" in done.stderr, done.stderr
        assert not view.envs() and not view.domains()

        def left() -> list[str]:
            return [f"{a.meta.id} {a.desired}" for a in view.assignments() if a.environment_id in env_ids]

        await eventually(lambda: not left(), 60, f"every replica stopped and reaped (left: {left()})")

        async def no_route() -> bool:
            snapshot = await route_snapshot(conn)
            return snapshot is not None and not any(r.environment_id in env_ids for r in snapshot.http_routes)

        await eventually(no_route, 30, "no route to the deleted envs")
        await eventually(lambda: not [r for r in view.releases() if r.environment_id in env_ids], 30, "releases pruned")
        await eventually(
            lambda: not [d for d in view.deployments() if d.environment_id in env_ids], 30, "deployments cleaned up"
        )

    # The proxy applies the route snapshot after it is written (HAProxy drops the host's backend at run
    # time), so its answer follows the snapshot within a moment rather than at once.
    async def not_found() -> bool:
        status, _ = await cluster.get(HOST)
        return status == 404

    await eventually(not_found, 10, "the proxy answers 404 for the deleted app's host")
    events = await cluster.acli("events", "--json", "--kind", "env.deleted")
    assert events.stdout.count('"kind": "env.deleted"') == 2
    failed = await cluster.acli("events", "--json", "--kind", "deploy.failed")
    assert '"kind"' not in failed.stdout, "the draining deployment ended with the env, not as a failure"
