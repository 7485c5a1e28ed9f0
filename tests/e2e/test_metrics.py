"""Metrics in a real run: every process of the cluster (services, two agents, the proxy) started with a
metrics port, each endpoint scraped over HTTP; the named series exist and move with the work done."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import E2ECluster, app_source, env_by_name, healthy
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROD = "demo/hello/production"
PROD_HOST = "hello.localhost"
SERVICES = {
    "scheduler": ("scheduler", "liveness"),
    "orchestrator": ("orchestrator",),
    "autoscale": ("autoscaler", "scaletozero", "serverless"),
    "builds": ("builds",),
    "routes": ("vips",),
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(tmp_path_factory.mktemp("metrics"), metrics=True, trace=False)
    try:
        c.start()
        asyncio.run(c.wait_ready())
        yield c
    finally:
        c.stop()


async def scrape(cluster: E2ECluster, process: str) -> Samples:
    """GET /metrics of ``process``: every sample as (name, labels) → value."""
    assert cluster.up is not None
    port = cluster.up.metrics_ports[process]
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


async def test_every_service_reports_its_loops_and_leases(cluster: E2ECluster) -> None:
    for service, loops in SERVICES.items():
        for loop in loops:

            async def leading(service: str = service, loop: str = loop) -> bool:
                samples = await scrape(cluster, service)
                return (
                    value(samples, "zattera_lease_terms_total", loop=loop) >= 1
                    and value(samples, "zattera_lease_held", loop=loop) == 1
                    and value(samples, "zattera_loop_pass_duration_seconds_count", loop=loop) >= 1
                )

            await eventually(leading, 30, f"{service}: {loop} leads and passes")


async def test_a_deploy_moves_decisions_proxy_requests_and_instance_figures(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    before = await scrape(cluster, "orchestrator")
    source = app_source(tmp_path / "v1", "v1")
    await cluster.acli("apps", "apply", str(source / "zattera.toml"))
    await cluster.acli("deploy", str(source), "--env", PROD)
    async with cluster.state() as (_, view):
        env = env_by_name(view, "production")
        assert env is not None
        env_id = env.meta.id
        instances = {a.meta.id: a.node_id for a in healthy(view, env_id)}
    assert instances

    after = await scrape(cluster, "orchestrator")
    decided = "zattera_decisions_total"
    assert value(after, decided, loop="orchestrator") > value(before, decided, loop="orchestrator")

    async def served() -> bool:
        status, _ = await cluster.get(PROD_HOST)
        return status == 200

    await eventually(served, 30, "the app answers through the proxy")
    counted = "zattera_proxy_request_duration_seconds_count"
    start = value(await scrape(cluster, "proxy"), counted, env=env_id, status_class="2xx")
    for _ in range(5):
        assert (await cluster.get(PROD_HOST))[0] == 200
    await cluster.get("nobody.localhost")  # no route: counted under env "none", 4xx

    async def counted_all() -> bool:
        # With the HAProxy data plane the counts arrive with its next stats sample (every heartbeat), so
        # ``start`` may still lack the requests of ``served``: at least the five are counted.
        proxy = await scrape(cluster, "proxy")
        return (
            value(proxy, counted, env=env_id, status_class="2xx") >= start + 5
            and value(proxy, counted, env="none", status_class="4xx") >= 1
            and value(proxy, "zattera_proxy_request_duration_seconds_bucket", env=env_id, le="+Inf") >= start + 5
        )

    await eventually(counted_all, 15, "the proxy's request metrics count the 5 requests and the 404")

    for instance, node in instances.items():

        async def sampled(instance: str = instance, node: str = node) -> bool:
            agent = await scrape(cluster, f"agent-{node}")
            memory = value(agent, "zattera_agent_instance_memory_bytes", instance=instance, env=env_id)
            cpu = [v for (n, labels), v in agent.items() if n == "zattera_agent_instance_cpu_percent"]
            return memory > 0 and bool(cpu)

        await eventually(sampled, 30, f"agent-{node} reports instance {instance}")
