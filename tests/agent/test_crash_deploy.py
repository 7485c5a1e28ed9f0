"""A real agent runs a crashing app for a real orchestrator: the deployment's error quotes the app's stderr."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import quote

from zattera.v1 import types_pb2 as pb

from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers
from shared.clock import FakeClock
from shared.connection import Connection
from shared.deploy import Deployer
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent
from tests.orchestrator.rig import environment, spec
from tests.waiting import eventually


async def test_a_crashing_apps_stderr_is_in_the_deployment_error(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer
) -> None:
    await writer.commit(writer.txn().put(environment("E1", spec(1))))
    await start_agent("n1")
    orchestrator = Orchestrator(LoopDeps(conn, view, FakeClock()), timers=Timers(), tick=3600.0)
    leader = asyncio.create_task(
        run_while_leading(conn, "orchestrator", orchestrator.run, holder="test", ttl=5, renew_interval=1)
    )
    try:
        command = "echo 'fatal: DATABASE_URL not set' >&2; exit 3"
        created = await Deployer(writer).deploy_image("E1", "exec:" + quote(command, safe=""))
        deployment_id = created.deployment.meta.id

        def failed() -> bool:
            d = view.deployment(deployment_id)
            return d is not None and d.phase == pb.DEPLOYMENT_PHASE_FAILED

        await eventually(failed, timeout=20, what="the deployment FAILED")
        d = view.deployment(deployment_id)
        assert d is not None
        # Which reference string leads depends on the phase the orchestrator is in when the crash is
        # observed (still starting, or already waiting for health): both must carry the crash details.
        assert d.error.startswith(
            ("a green instance failed to start: instance ", "a green instance became unhealthy: instance ")
        )
        assert d.error.endswith(" on n1: exit code 3; last stderr: fatal: DATABASE_URL not set")
    finally:
        leader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader


async def test_an_app_that_dies_within_the_minimum_healthy_time_fails_its_deploy(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer
) -> None:
    """No health check, two replicas, a process that runs one second and exits 3: it was HEALTHY at once
    (and the deploy succeeded); now it must run ``min_healthy_time`` first, so the deploy fails with the
    exit code and the stderr tail."""
    service = spec(2)
    service.min_healthy_time.FromSeconds(3)
    await writer.commit(writer.txn().put(environment("E1", service)))
    await start_agent("n1")
    orchestrator = Orchestrator(LoopDeps(conn, view, FakeClock()), timers=Timers(), tick=3600.0)
    leader = asyncio.create_task(
        run_while_leading(conn, "orchestrator", orchestrator.run, holder="test", ttl=5, renew_interval=1)
    )
    try:
        command = "echo 'listening on :8080'; sleep 1; echo 'fatal: lost the database' >&2; exit 3"
        created = await Deployer(writer).deploy_image("E1", "exec:" + quote(command, safe=""))
        deployment_id = created.deployment.meta.id

        def ended() -> bool:
            d = view.deployment(deployment_id)
            return d is not None and d.phase in (pb.DEPLOYMENT_PHASE_FAILED, pb.DEPLOYMENT_PHASE_SUCCEEDED)

        await eventually(ended, timeout=30, what="the deployment ended")
        d = view.deployment(deployment_id)
        assert d is not None and d.phase == pb.DEPLOYMENT_PHASE_FAILED, pb.DeploymentPhase.Name(d.phase) if d else d
        assert d.error.startswith(
            ("a green instance failed to start: instance ", "a green instance became unhealthy: instance ")
        ), d.error
        assert d.error.endswith(" on n1: exit code 3; last stderr: fatal: lost the database")
        env = view.env("E1")
        assert env is not None and env.active_release_id != d.release_id  # never promoted
    finally:
        leader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader
