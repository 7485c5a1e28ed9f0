"""Deployment outcome events from the orchestrator loop on real NATS with a fake clock: succeeded (with
the promotion before it), failed with its reason, canceled, superseded, rolled back; each named after its
transition, so a re-publication or a new leader adds no duplicate."""

from __future__ import annotations

import asyncio
import contextlib

from zattera.v1 import types_pb2 as pb

from services.orchestrator.loop import Orchestrator
from shared.connection import Connection
from shared.events import EventPublisher
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.state.feed import StateView
from tests.eventlog import one, stored_events, stored_kinds, wait_for_kinds
from tests.orchestrator.rig import deployment
from tests.orchestrator.test_loop import ENV, HOUR, PH, TIMERS, Running


async def test_a_deploy_announces_its_promotion_then_its_success(running: Running, conn: Connection) -> None:
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    await running.clock.advance(TIMERS.drain_window)
    events = await wait_for_kinds(conn, "deploy.promoted", "deploy.succeeded")
    assert [e.kind for e in events] == ["deploy.promoted", "deploy.succeeded"]
    succeeded = one(events, "deploy.succeeded")
    assert succeeded.environment_id == ENV and succeeded.severity == "info"
    assert succeeded.fields["deployment_id"] == dep
    assert succeeded.fields["release_id"] == created.release.meta.id
    version = f"v{created.release.version}"
    assert succeeded.fields["release"] == version and succeeded.message == f"deployment of release {version} succeeded"
    assert succeeded.fields["previous_release_id"] == "rel1"
    assert (succeeded.fields["from_phase"], succeeded.fields["to_phase"]) == ("DRAINING_OLD", "SUCCEEDED")
    assert succeeded.transition.startswith(f"deployment.{dep}@") and succeeded.transition.endswith(":deploy.succeeded")
    assert succeeded.meta.created_at.ToNanoseconds() == int(running.clock.now() * 1e9)


async def test_a_failed_deploy_names_its_reason(running: Running, conn: Connection) -> None:
    running.agent.green_state = pb.INSTANCE_STATE_RUNNING
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_HEALTHCHECKING)
    await running.clock.advance(180.01)
    failed = one(await wait_for_kinds(conn, "deploy.failed"), "deploy.failed")
    assert failed.severity == "error"
    assert failed.message == failed.fields["reason"] == "green instances did not become healthy in time"
    assert failed.fields["from_phase"] == "HEALTHCHECKING"


async def test_a_canceled_deploy_is_announced_as_canceled(running: Running, conn: Connection) -> None:
    running.agent.green_state = None
    created = await running.deployer.deploy_image(ENV, "app:v2")
    dep = created.deployment.meta.id
    await running.reaches(dep, PH.DEPLOYMENT_PHASE_STARTING)
    await running.deployer.cancel(dep)
    events = await wait_for_kinds(conn, "deploy.canceled")
    assert "deploy.failed" not in [e.kind for e in events]
    assert one(events, "deploy.canceled").fields["deployment_id"] == dep


async def test_a_superseded_deploy_is_announced(running: Running, conn: Connection) -> None:
    running.agent.green_state = None
    first = await running.deployer.deploy_image(ENV, "app:v2")
    await running.reaches(first.deployment.meta.id, PH.DEPLOYMENT_PHASE_STARTING)
    # A newer deployment written beside it (the Deployer refuses one while another is under way).
    newer = deployment("dep-newer", ENV, "rel1", previous="rel1", now=running.clock.now() + 1)
    await running.writer.commit(running.writer.txn().put(newer))
    superseded = one(await wait_for_kinds(conn, "deploy.superseded"), "deploy.superseded")
    assert superseded.fields["deployment_id"] == first.deployment.meta.id
    assert superseded.severity == "warning" and superseded.fields["to_phase"] == "SUPERSEDED"


async def test_a_rollback_is_announced_when_traffic_moves_back(running: Running, conn: Connection) -> None:
    created = await running.deployer.deploy_image(ENV, "app:v2")
    await running.reaches(created.deployment.meta.id, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    rollback = await running.deployer.rollback(ENV)
    await running.reaches(rollback.meta.id, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    await running.clock.advance(TIMERS.drain_window)
    events = await wait_for_kinds(conn, "deploy.rolled_back")
    await running.reaches(rollback.meta.id, PH.DEPLOYMENT_PHASE_SUCCEEDED)
    events = await wait_for_kinds(conn, "deploy.rolled_back", "deploy.succeeded")
    rolled_back = one(events, "deploy.rolled_back")
    assert rolled_back.fields["trigger"] == "operator" and rolled_back.fields["release_id"] == "rel1"
    assert rolled_back.fields["rollback"] == "true"
    # The first deploy succeeds (superseded after its promotion), then the rollback itself.
    await wait_for_kinds(conn, "deploy.succeeded")
    succeeded = [e.fields["deployment_id"] for e in await stored_events(conn) if e.kind == "deploy.succeeded"]
    assert created.deployment.meta.id in succeeded


async def test_a_transition_is_stored_once_whoever_publishes_it_again(running: Running, conn: Connection) -> None:
    created = await running.deployer.deploy_image(ENV, "app:v2")
    await running.reaches(created.deployment.meta.id, PH.DEPLOYMENT_PHASE_DRAINING_OLD)
    events = await wait_for_kinds(conn, "deploy.promoted")
    # A publish retried after a lost ack, or a replay: the stream drops the copy (Nats-Msg-Id).
    await EventPublisher(conn).publish(*events)
    assert await stored_kinds(conn) == ["deploy.promoted"]
    # A new leader resuming from durable state re-announces nothing that already happened.
    view = StateView(conn, name="second-leader")
    await view.start()
    successor = Orchestrator(LoopDeps(conn, view, running.clock), timers=TIMERS, tick=HOUR)
    standby = asyncio.create_task(
        run_while_leading(conn, "orchestrator", successor.run, holder="second", ttl=5, renew_interval=1)
    )
    try:
        await successor.pass_once()  # what its term would start with, had it the lease
        assert await stored_kinds(conn) == ["deploy.promoted"]
    finally:
        standby.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await standby
        await view.stop()
