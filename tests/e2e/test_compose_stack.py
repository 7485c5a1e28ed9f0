"""compose.yaml and the Dockerfile for real: ``docker-compose`` (Debian's 1.29) runs both shapes of the control
plane on the session's private dockerd, from images made once on this machine (``cli/stack_images.py``: no
registry), on the project's bridge network with published ports, driven by the real CLI on the host.

One compose project serves the module: NATS, the agent (a builder) and the proxy come up once; each test
brings its shape's control plane up beside them and stops it at its end, so the two shapes run in turn on
the same cluster (the secrets key and the local CA are in volumes both mount).

* all-in-one: examples/hello deployed from source through it answers 200 through the composed proxy;
* per-service: one container per service, two of each leader-loop service, every one healthy, limited and
  restarted by policy, each loop led from a container of its own service; a rollout in flight survives
  ``docker kill`` of the container holding ``lease.orchestrator``: the other replica takes the lease, the
  rollout completes, and not one request of a steady client fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from zattera.v1 import types_pb2 as pb

from shared.connection import Connection, connect
from shared.deployments import is_terminal
from shared.state.feed import StateView
from tests.e2e.cluster import Load, cli_argv, env_by_name
from tests.e2e.compose import ComposeUnavailable, Stack, composed, run
from tests.leases import LOOPS_OF
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

PH = pb.DeploymentPhase
ENV = "demo/hello/production"
HOST = "hello.localhost"


@pytest.fixture(scope="module")
def stack(docker_host: str) -> Iterator[Stack]:
    """NATS, the agent and the proxy composed and up; the images made once for the module."""
    try:
        # the first health verdict sooner than the default 30 s
        with composed(docker_host, ZATTERA_HEALTH_INTERVAL="15s") as stack:
            yield stack
    except ComposeUnavailable as exc:
        pytest.skip(str(exc))


async def zattera(stack: Stack, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, [*cli_argv(), *args], stack.env, timeout)


@contextlib.asynccontextmanager
async def state(stack: Stack) -> AsyncIterator[tuple[Connection, StateView]]:
    conn = await connect(stack.env["ZATTERA_NATS_URL"], name="compose-test")
    view = StateView(conn, name="compose-test")
    try:
        await view.start()
        yield conn, view
    finally:
        await view.stop()
        await conn.close()


def confirmed_holder(view: StateView) -> pb.Lease | None:
    """``lease.orchestrator`` once its holder confirmed it (an acquiring write carries term 0)."""
    lease = view.lease("orchestrator")
    return lease if lease is not None and lease.term > 0 else None


def hostname_of(holder: str) -> str:
    """The host of a lease holder, ``<service>@<host>:<pid>:<suffix>``: in a container, its short id."""
    return holder.split("@", 1)[1].rsplit(":", 2)[0]


async def deploy_from_source(stack: Stack) -> None:
    async def node_registered() -> bool:
        listed = await zattera(stack, "nodes", "list", "--json")
        return listed.returncode == 0 and any(n["meta"]["id"] == "compose-node" for n in json.loads(listed.stdout))

    await eventually(node_registered, 120, "the composed agent registers")
    applied = await zattera(stack, "apps", "apply", "examples/hello/zattera.toml")
    assert applied.returncode == 0, applied.stderr
    deployed = await zattera(stack, "deploy", "examples/hello", "--env", ENV)
    assert deployed.returncode == 0 and "live: release" in deployed.stderr, deployed.stdout + deployed.stderr


def get_hello(stack: Stack) -> dict[str, str]:
    proxy = http.client.HTTPConnection("127.0.0.1", int(stack.env["ZATTERA_PROXY_PORT"]), timeout=10)
    try:
        proxy.request("GET", "/", headers={"Host": HOST})
        response = proxy.getresponse()
        assert response.status == 200
        body: dict[str, str] = json.loads(response.read())
        return body
    finally:
        proxy.close()


def assert_run_by_policy(container: dict[str, Any]) -> None:
    """Restarted by policy, limited, health-checked."""
    host = container["HostConfig"]
    assert host["RestartPolicy"]["Name"] == "unless-stopped", container["Name"]
    assert host["Memory"] > 0 and host["NanoCpus"] > 0, container["Name"]
    assert container["Config"]["Healthcheck"]["Test"][:3] == ["CMD", "/bin/sh", "/app/shared/health.sh"]


async def test_the_all_in_one_shape_deploys_the_example_app_from_source(stack: Stack) -> None:
    try:
        async with stack.shape("all-in-one"), state(stack) as (_, view):
            [container] = await stack.containers("control-plane")
            assert_run_by_policy(container)
            with stack.timed("all-in-one: deployed from source"):
                await deploy_from_source(stack)
            # every loop leads from the one container
            assert {hostname_of(lease.holder) for lease in map(view.lease, LOOPS_OF["allinone"]) if lease} == {
                container["Config"]["Hostname"]
            }
            body = await asyncio.to_thread(get_hello, stack)
            assert body["hello"] == "world" and body["node"] == "compose-node"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.logs()}") from None


@pytest.mark.chaos  # 19 containers: several minutes on a vfs daemon (docs/containers.md); `make chaos` runs it
async def test_the_per_service_shape_survives_killing_the_orchestrator_leader_mid_deploy(stack: Stack) -> None:
    try:
        async with stack.shape("per-service") as services, state(stack) as (_, view):
            await per_service_shape(stack, services, view)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.logs('orchestrator', 'scheduler', 'agent', 'proxy')}") from None


async def per_service_shape(stack: Stack, services: Sequence[str], view: StateView) -> None:
    hosts: dict[str, set[str]] = {}
    for service in services:
        found = await stack.containers(service)
        assert len(found) == (1 if service == "console" else 2), f"{service}: {len(found)} containers"
        for c in found:
            assert_run_by_policy(c)
        hosts[service] = {c["Config"]["Hostname"] for c in found}

    def led_by_their_own_service() -> bool:
        for service in services:
            for loop in LOOPS_OF[service]:
                lease = view.lease(loop)
                if lease is None or hostname_of(lease.holder) not in hosts[service]:
                    return False
        return True

    await eventually(led_by_their_own_service, 60, "every loop led from a container of its own service")
    if env_by_name(view, "production") is None or not view.deployments(env_by_name(view, "production").meta.id):
        await deploy_from_source(stack)  # this test alone: the all-in-one one did not deploy it
    env = env_by_name(view, "production")
    assert env is not None
    before = {d.meta.id for d in view.deployments(env.meta.id)}
    version = f"v{uuid.uuid4().hex[:6]}"

    load = Load(int(stack.env["ZATTERA_PROXY_PORT"]), HOST, rate=10).start()
    try:
        await eventually(lambda: load.ok >= 10, 120, "the app answering through the proxy")
        # a release that takes 4 s to become healthy: the rollout is surely in flight when the kill lands
        rollout = asyncio.create_task(
            zattera(stack, "config", "set", f"HELLO_VERSION={version}", "HELLO_START_DELAY=4", "--env", ENV)
        )

        def in_flight() -> pb.Deployment | None:
            new = [d for d in view.deployments(env.meta.id) if d.meta.id not in before]
            return new[0] if new and not is_terminal(new[0].phase) else None

        await eventually(lambda: in_flight() is not None or rollout.done(), 60, "the rollout under way")
        deployment = in_flight()
        assert deployment is not None, "the rollout ended before the kill"
        phase_at_kill = pb.DeploymentPhase.Name(deployment.phase)
        await eventually(lambda: confirmed_holder(view) is not None, 30, "a confirmed orchestrator leader")
        leader = confirmed_holder(view)
        assert leader is not None and hostname_of(leader.holder) in hosts["orchestrator"], leader
        killed = hostname_of(leader.holder)
        killed_at = time.monotonic()
        await stack.kill(killed)

        def successor() -> pb.Lease | None:
            lease = confirmed_holder(view)
            return lease if lease is not None and lease.term > leader.term else None

        await eventually(lambda: successor() is not None, 30, "the other orchestrator replica takes the lease")
        takeover = time.monotonic() - killed_at
        new_leader = successor()
        assert new_leader is not None and hostname_of(new_leader.holder) in hosts["orchestrator"] - {killed}

        with stack.timed("per-service: the rollout completed after the kill"):
            done = await asyncio.wait_for(rollout, 240)
        assert done.returncode == 0 and "live" in done.stderr, done.stdout + done.stderr
        final = view.deployment(deployment.meta.id)
        # promoted: the old release stays warm for the drain window (DRAINING_OLD), then SUCCEEDED
        assert final is not None and final.phase in (PH.DEPLOYMENT_PHASE_DRAINING_OLD, PH.DEPLOYMENT_PHASE_SUCCEEDED)
        await eventually(lambda: load.versions[version] >= 10, 60, "the new release answering")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nclient: {load.summary()}") from None
    finally:
        await load.stop()
    assert not load.failures, load.summary()
    assert load.versions[version] > 0 and len(load.versions) == 2, load.summary()
    print(
        f"\nkilled the orchestrator leader {killed} in {phase_at_kill}; takeover in {takeover:.1f}s; {load.summary()}"
    )
