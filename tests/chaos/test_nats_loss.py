"""On a 3-server cluster, SIGKILL the JetStream meta leader, each stream's leader and the
server the workload's client is connected to (``make chaos``; ``make test`` loses the meta leader only), each
during a deploy, a scale change, a cooling and a build at once. While the server is down the CLI (default
settings) keeps answering, the services go on, routes keep publishing; every deployment and build completes,
the env cools, no acknowledged write is lost; the restarted server rejoins and catches up (its replicas
current again)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration
from typer.testing import CliRunner
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.main import app
from shared.live import publish_proxy_heartbeat
from shared.subjects import ROUTES_STREAM
from tests.builds import seed as build_seed
from tests.builds.fake_builder import FakeBuilder, instant_success
from tests.chaos.cluster import META_LEADER, NATS_ROLES
from tests.chaos.verdict import verdict
from tests.chaos.workload import STATELESS, Run
from tests.orchestrator.rig import copied, environment, release, spec
from tests.waiting import eventually

COLD = "cold-1"
BUILDER = "w1"


def cli_read(urls: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["--nats", urls, *args])
    return result.exit_code, result.output


async def routes_last_seq(run: Run) -> int:
    for _ in range(50):
        with contextlib.suppress(Exception):
            return int((await run.conn.js.stream_info(ROUTES_STREAM)).state.last_seq)
        await asyncio.sleep(0.2)
    return 0


async def proxy_heartbeats(run: Run, stop: asyncio.Event) -> None:
    """A proxy that sees no traffic (fresh data: the scale-to-zero loop may cool idle envs)."""
    while not stop.is_set():
        hb = cpb.ProxyHeartbeat(proxy_id="chaos-proxy", node_id=BUILDER)
        hb.time.GetCurrentTime()
        with contextlib.suppress(Exception):
            await publish_proxy_heartbeat(run.conn, hb)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def setup_builder_and_cold_env(run: Run) -> FakeBuilder:
    def builder_node() -> pb.Node:
        n = copied(run.watcher.node(BUILDER))
        n.labels["builder"] = "true"
        return n

    await run.write(builder_node)
    s = spec(1)
    s.scale_to_zero = True
    cold_env = environment(COLD, s, active=f"{COLD}-r1")
    cold_env.idle_timeout.CopyFrom(Duration(seconds=2))
    cold_env.effective_replicas = 1
    await run.writer.commit(run.writer.txn("seed").put(release(f"{COLD}-r1", COLD, "cold:v1", s)).put(cold_env))
    return await FakeBuilder(run.conn, BUILDER, script=instant_success).start()


async def wake(run: Run) -> None:
    def build() -> pb.Environment:
        env = copied(run.watcher.env(COLD))
        env.effective_replicas = 1
        return env

    await run.write(build)


async def lose_a_server_mid_operation(run: Run, i: int, role: str) -> None:
    """One kill of the server in ``role``, during a deploy, a scale change, a cooling and a build; restarted
    once each has completed without it."""
    await eventually(lambda: (e := run.watcher.env(COLD)) is not None and e.effective_replicas == 0, 60, "cooled")
    await wake(run)
    build_id = f"chaos-build-{i}"
    build = build_seed.build(build_id)
    build.environment_id = COLD  # an env that exists: the retention loop deletes finished builds of deleted ones
    await run.writer.commit(run.writer.txn("workload").put(build))
    routes_before = await routes_last_seq(run)
    victim = await run.nats.server_in_role(run.conn, role)
    deploying = asyncio.create_task(run.deploy(STATELESS[0]))
    run.nats.kill(victim)
    run.stats.fault(f"sigkill nats {role}")
    await run.scale(STATELESS[1], 3 if i % 2 == 0 else 1)
    for command in (("deploy", "list", "--json"), ("ps", "--json"), ("cluster", "status", "--json")):
        code, out = await asyncio.to_thread(cli_read, run.nats.urls, *command)
        assert code == 0 and "Traceback" not in out, f"{role}: zattera {' '.join(command)}: {out}"
    deployment = await deploying
    if deployment is not None:
        await run.wait_terminal(deployment)
    await eventually(
        lambda: (b := run.watcher.build(build_id)) is not None and b.status == pb.BUILD_STATUS_SUCCEEDED,
        60,
        f"{build_id} built while {role} was down",
    )
    await eventually(
        lambda: (e := run.watcher.env(COLD)) is not None and e.effective_replicas == 0,
        60,
        f"{COLD} cooled while {role} was down",
    )

    async def routes_published() -> bool:
        return await routes_last_seq(run) > routes_before

    await eventually(routes_published, 60, f"a route snapshot published while {role} was down")
    run.nats.restart(victim)
    await run.nats.provision()  # the restarted server's replicas are current again: it caught up
    await run.marker()


@pytest.mark.parametrize(
    "roles",
    [
        # make test: the JetStream meta leader (every JetStream API request waits for the next one).
        pytest.param((META_LEADER,), id="meta-leader"),
        pytest.param(NATS_ROLES, id="every-role", marks=pytest.mark.chaos),
    ],
)
@pytest.mark.timeout(1200)
async def test_losing_any_nats_server_mid_operation_is_survivable(tmp_path: Path, roles: tuple[str, ...]) -> None:
    run = await Run.start(tmp_path)
    stop = asyncio.Event()
    heartbeats = asyncio.create_task(proxy_heartbeats(run, stop))
    builder: FakeBuilder | None = None
    try:
        await run.seed()
        await run.marker()
        builder = await setup_builder_and_cold_env(run)
        for i, role in enumerate(roles):
            await lose_a_server_mid_operation(run, i, role)
        await verdict(run)
    finally:
        stop.set()
        heartbeats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeats
        if builder is not None:
            await builder.stop()
        await run.close()
