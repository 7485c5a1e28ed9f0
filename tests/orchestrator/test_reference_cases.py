"""The reference's orchestrator test catalogue, stepped one
decision at a time on real NATS with a fake clock."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from tests.factories import node
from tests.orchestrator.rig import (
    PH,
    RUN,
    STOP,
    Rig,
    copied,
    deployment,
    environment,
    make_rig,
    release,
    seed_deploy_rig,
    seed_stateful_rig,
    spec,
)

HEALTHY = pb.INSTANCE_STATE_HEALTHY
RUNNING = pb.INSTANCE_STATE_RUNNING
FAILED = pb.INSTANCE_STATE_FAILED
STOPPED = pb.INSTANCE_STATE_STOPPED
DRAIN_WINDOW = 600.0


@pytest.fixture
async def rig(conn: Connection) -> AsyncIterator[Rig]:
    async with make_rig(conn) as r:
        yield r


@pytest.fixture
async def deploy_rig(rig: Rig) -> Rig:
    await seed_deploy_rig(rig)
    return rig


@pytest.fixture
async def stateful_rig(rig: Rig) -> Rig:
    await seed_stateful_rig(rig)
    return rig


# ---------------------------------------------------------------------- §9.1 deploy rig


async def test_u1_happy_path_walks_to_succeeded_and_promotes_traffic(deploy_rig: Rig) -> None:
    rig = deploy_rig
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_PLACING
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STARTING
    assert [a.node_id for a in rig.green()] == ["n1", "n2"]
    await rig.observe(rig.green(), RUNNING)
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_HEALTHCHECKING
    await rig.observe(rig.green(), HEALTHY)
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_PROMOTING
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    assert rig.env().active_release_id == "rel2"
    assert rig.env().route_generation != 0
    assert [a.desired for a in rig.blue()] == [RUN, RUN]
    await rig.clock.advance(DRAIN_WINDOW + 60)
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert [a.desired for a in rig.blue()] == [STOP, STOP]
    assert len(rig.green()) == 2


async def test_u2_failing_green_aborts_and_leaves_blue_untouched(deploy_rig: Rig) -> None:
    rig = deploy_rig
    await rig.steps(2)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STARTING
    await rig.observe(rig.green()[:1], FAILED)
    await rig.step()
    d = rig.deployment()
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED
    assert d.error == "a green instance failed to start"
    assert [a for a in rig.view.assignments(rig.env_id) if a.deployment_id == "dep1"] == []
    assert [a.desired for a in rig.blue()] == [RUN, RUN]
    assert rig.env().active_release_id == "rel1"


async def test_u3_rollback_within_the_drain_window_promotes_immediately(deploy_rig: Rig) -> None:
    rig = deploy_rig
    env = copied(rig.env())
    env.active_release_id = "rel2"
    await rig.put(env)
    await rig.observe(rig.blue(), HEALTHY)
    await rig.clock.advance(60)
    await rig.put(deployment("roll1", rig.env_id, "rel1", previous="rel2", now=rig.clock.now(), is_rollback=True))
    await rig.step("roll1")
    assert rig.phase("roll1") == PH.DEPLOYMENT_PHASE_PROMOTING


async def test_u4_newer_deployment_supersedes_the_older(deploy_rig: Rig) -> None:
    rig = deploy_rig
    await rig.clock.advance(60)
    await rig.put(deployment("dep2", rig.env_id, "rel2", previous="rel1", now=rig.clock.now()))
    await rig.step("dep1")
    d = rig.deployment("dep1")
    assert d.phase == PH.DEPLOYMENT_PHASE_SUPERSEDED
    assert d.error == "superseded by a newer deployment"


async def test_u5_newer_deployment_never_reaps_a_promoted_ones_live_green(deploy_rig: Rig) -> None:
    rig = deploy_rig
    await rig.steps(2)
    await rig.observe(rig.green(), HEALTHY)
    await rig.steps(3)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    assert len(rig.green()) == 2
    await rig.clock.advance(60)
    await rig.put(deployment("dep2", rig.env_id, "rel2", previous="rel2", now=rig.clock.now()))
    await rig.step("dep1")
    assert rig.phase("dep1") == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert len(rig.green("dep1")) == 2
    assert [a.desired for a in rig.blue()] == [RUN, RUN]


async def test_u6_stateful_release_uses_stop_then_start(deploy_rig: Rig) -> None:
    rig = deploy_rig
    rel2 = copied(rig.view.release("rel2"))
    assert rel2 is not None
    rel2.service.stateful = True
    await rig.put(rel2)
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STOPPING_OLD


# ---------------------------------------------------------------------- §9.2 stateful rig


async def step_safe(rig: Rig, deployment_id: str = "dep1") -> None:
    """A step, then the never-double-run check (at most one desired-RUN instance for the volume)."""
    await rig.step(deployment_id)
    assert len(rig.running()) <= 1, [a.meta.id for a in rig.running()]


async def test_u7_stop_then_start_walks_to_succeeded_without_double_run(stateful_rig: Rig) -> None:
    rig = stateful_rig
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STOPPING_OLD
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STOPPING_OLD
    assert rig.running() == []
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STOPPING_OLD  # the old container is still alive (HEALTHY)
    await rig.observe(rig.blue(), STOPPED)
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STARTING
    await step_safe(rig)
    green = rig.green()
    assert [a.node_id for a in green] == ["n1"]
    await rig.observe(green, RUNNING)
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_HEALTHCHECKING
    await rig.observe(green, HEALTHY)
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_PROMOTING
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert rig.env().active_release_id == "rel2"
    assert len(rig.running()) == 1


async def test_u8_first_stateful_deploy_auto_creates_the_volume(stateful_rig: Rig) -> None:
    rig = stateful_rig
    await rig.delete(K.assignment("n1", "blue-0"), K.volume("vol-data"))
    d = copied(rig.deployment())
    d.previous_release_id = ""
    env = copied(rig.env())
    env.active_release_id = ""
    await rig.put(d, env)
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STOPPING_OLD
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STARTING
    await step_safe(rig)
    volumes = [v for v in rig.view.volumes(rig.env_id) if v.name == "data"]
    assert len(volumes) == 1
    assert volumes[0].status == pb.VOLUME_STATUS_ACTIVE
    assert [a.node_id for a in rig.green()] == [volumes[0].node_id]


async def walk_stateful_to_starting_with_green(rig: Rig) -> list[pb.Assignment]:
    await step_safe(rig)
    await step_safe(rig)
    await rig.observe(rig.blue(), STOPPED)
    await step_safe(rig)
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_STARTING
    green = rig.green()
    assert len(green) == 1
    return green


async def test_u9_failure_after_stopping_old_restarts_it_and_fails(stateful_rig: Rig) -> None:
    rig = stateful_rig
    green = await walk_stateful_to_starting_with_green(rig)
    await rig.observe(green, FAILED)
    await step_safe(rig)
    d = rig.deployment()
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED
    assert d.error == "the new instance failed to start"
    assert rig.green() == []
    assert [a.desired for a in rig.blue()] == [RUN]
    assert rig.env().active_release_id == "rel1"


async def test_u10_health_check_timeout_restarts_old(stateful_rig: Rig) -> None:
    rig = stateful_rig
    green = await walk_stateful_to_starting_with_green(rig)
    await rig.observe(green, RUNNING)
    await step_safe(rig)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_HEALTHCHECKING
    await rig.clock.advance(180 + 60)
    await step_safe(rig)
    d = rig.deployment()
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED
    assert d.error == "the new instance did not become healthy in time"
    assert [a.desired for a in rig.blue()] == [RUN]


# ---------------------------------------------------------------------- §9.3 build gating


async def seed_build_gate(rig: Rig, build_status: int, *, error: str = "") -> None:
    s = spec(1, max_replicas=3)
    rel = release("rel-b", rig.env_id, "", s)
    build = pb.Build(environment_id=rig.env_id, project_id="p1", app_id="a1", status=build_status, error=error)  # type: ignore[arg-type]
    build.meta.id = "b1"
    await rig.put(
        node("n1", cpu=1000, mem=4096),
        environment(rig.env_id, s),
        rel,
        build,
        deployment("d1", rig.env_id, "rel-b", build_id="b1"),
    )


async def test_u11_building_gate_waits_for_the_build_then_stamps_the_image(rig: Rig) -> None:
    await seed_build_gate(rig, pb.BUILD_STATUS_RUNNING)
    await rig.step("d1")
    assert rig.phase("d1") == PH.DEPLOYMENT_PHASE_BUILDING
    await rig.step("d1")
    assert rig.phase("d1") == PH.DEPLOYMENT_PHASE_BUILDING
    build = copied(rig.view.build("b1"))
    assert build is not None
    build.status = pb.BUILD_STATUS_SUCCEEDED
    build.image_ref = "ctrl:5000/proj1/app1@sha256:abc123"
    build.platforms[:] = ["linux/arm64"]
    await rig.put(build)
    await rig.step("d1")
    assert rig.phase("d1") == PH.DEPLOYMENT_PHASE_PLACING
    rel = rig.view.release("rel-b")
    assert rel is not None
    assert rel.image_ref == "ctrl:5000/proj1/app1@sha256:abc123"
    assert list(rel.platforms) == ["linux/arm64"]


async def test_u12_failed_build_fails_the_deployment(rig: Rig) -> None:
    await seed_build_gate(rig, pb.BUILD_STATUS_FAILED, error="compile error")
    d = copied(deployment("d1", rig.env_id, "rel-b", build_id="b1"))
    d.phase = PH.DEPLOYMENT_PHASE_BUILDING
    await rig.put(d)
    await rig.step("d1")
    d = rig.deployment("d1")
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED
    assert d.error == "build failed: compile error"
