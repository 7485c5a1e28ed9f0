"""Deployment creation (shared/deploy.py) on real NATS: the reference's API cases, build and
source deploys, rollback targets, cancel, validation naming the field, and concurrent deploys."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
from zattera.v1 import types_pb2 as pb

from shared.actions.refusals import ActionRefused, Refusal
from shared.connection import Connection, connect
from shared.deploy import (
    Deployer,
    DeployError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    config_hash,
)
from shared.state.feed import StateView
from shared.txn import Writer
from tests.orchestrator.rig import copied, environment, spec
from tests.waiting import eventually

ENV = "env-a"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
async def deployer(writer: Writer) -> Deployer:
    app = pb.App(project_id="p1", name="a1")
    app.meta.id = "a1"
    app.build.platforms.append("linux/arm64")
    await writer.commit(writer.txn().put(environment(ENV, spec(2))).put(app))
    return Deployer(writer, created_by="u1")


async def finish(writer: Writer, d: pb.Deployment, phase: int = pb.DEPLOYMENT_PHASE_SUCCEEDED) -> None:
    """Play the orchestrator: the deployment ends in ``phase``; a success makes its release active."""
    view = writer.view
    done = copied(view.deployment(d.meta.id))
    assert done is not None
    done.phase = phase  # type: ignore[assignment]
    txn = writer.txn().put(done)
    if phase in (pb.DEPLOYMENT_PHASE_SUCCEEDED, pb.DEPLOYMENT_PHASE_DRAINING_OLD):
        env = copied(view.env(d.environment_id))
        assert env is not None
        env.active_release_id = d.release_id
        txn.put(env)
    await writer.commit(txn)


async def test_a1_deploy_image_creates_a_pending_deployment_and_release_v1(deployer: Deployer, view: StateView) -> None:
    created = await deployer.deploy_image(ENV, "nginx:1")
    d, rel = created.deployment, created.release
    assert d.phase == pb.DEPLOYMENT_PHASE_PENDING and d.previous_release_id == "" and not d.is_rollback
    assert d.build_id == "" and d.created_by_user_id == "u1"
    assert rel.version == 1 and rel.image_ref == "nginx:1"
    env = view.env(ENV)
    assert env is not None
    assert rel.service == env.service and rel.config_hash == config_hash(env.service)
    assert view.deployment(d.meta.id) == d and view.release(rel.meta.id) == rel


async def test_a2_second_deploy_while_the_first_is_pending_is_refused(deployer: Deployer) -> None:
    await deployer.deploy_image(ENV, "nginx:1")
    with pytest.raises(FailedPrecondition, match=r"^a deployment is already in progress for this environment$"):
        await deployer.deploy_image(ENV, "nginx:2")


async def test_a3_next_deploy_gets_v2_and_the_active_release_as_previous(deployer: Deployer, writer: Writer) -> None:
    first = await deployer.deploy_image(ENV, "nginx:1")
    await finish(writer, first.deployment)
    second = await deployer.deploy_image(ENV, "nginx:2")
    assert second.release.version == 2
    assert second.deployment.previous_release_id == first.release.meta.id


async def test_a4_rollback_targets_the_previous_version_without_minting_a_release(
    deployer: Deployer, writer: Writer, view: StateView
) -> None:
    first = await deployer.deploy_image(ENV, "nginx:1")
    await finish(writer, first.deployment)
    second = await deployer.deploy_image(ENV, "nginx:2")
    await finish(writer, second.deployment)
    rollback = await deployer.rollback(ENV)
    assert rollback.release_id == first.release.meta.id
    assert rollback.previous_release_id == second.release.meta.id
    assert rollback.is_rollback
    assert len(view.releases(ENV)) == 2


async def test_a5_cancel_of_an_unknown_deployment_is_not_found(deployer: Deployer) -> None:
    with pytest.raises(NotFound, match=r"^deployment not found$"):
        await deployer.cancel("01NOPE")


async def test_a6_neither_image_nor_build_is_an_invalid_argument_naming_image_ref(deployer: Deployer) -> None:
    with pytest.raises(InvalidArgument) as err:
        await deployer.deploy(ENV)
    assert err.value.field == "image_ref"
    assert str(err.value) == "image_ref: either image_ref or build_id is required"
    with pytest.raises(NotFound, match=r"^environment not found$"):
        await deployer.deploy_image("env-missing", "nginx:1")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"environment_id": "bad.env", "image_ref": "nginx:1"}, "environment_id"),
        ({"environment_id": "", "image_ref": "nginx:1"}, "environment_id"),
        ({"environment_id": ENV, "image_ref": "nginx: 1"}, "image_ref"),
        ({"environment_id": ENV, "image_ref": "nginx:1", "build_id": "b1"}, "build_id"),
        ({"environment_id": ENV, "build_id": "b*1"}, "build_id"),
    ],
)
async def test_validation_errors_name_the_field(deployer: Deployer, kwargs: dict[str, str], field: str) -> None:
    env_id = kwargs.pop("environment_id")
    with pytest.raises(InvalidArgument) as err:
        await deployer.deploy(env_id, **kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


async def test_source_deploy_validates_the_tarball_digest(deployer: Deployer) -> None:
    with pytest.raises(InvalidArgument) as err:
        await deployer.deploy_source(ENV, tarball_digest="md5:abc")
    assert err.value.field == "tarball_digest"


async def test_a_new_deploy_may_start_while_the_previous_one_drains(deployer: Deployer, writer: Writer) -> None:
    first = await deployer.deploy_image(ENV, "nginx:1")
    await finish(writer, first.deployment, pb.DEPLOYMENT_PHASE_DRAINING_OLD)
    second = await deployer.deploy_image(ENV, "nginx:2")
    assert second.deployment.previous_release_id == first.release.meta.id


async def test_deploy_of_a_build_copies_its_image_and_platforms(deployer: Deployer, writer: Writer) -> None:
    with pytest.raises(NotFound, match=r"^build not found$"):
        await deployer.deploy_build(ENV, "b1")
    build = pb.Build(environment_id=ENV, status=pb.BUILD_STATUS_RUNNING)
    build.meta.id = "b1"
    await writer.commit(writer.txn().put(build))
    with pytest.raises(FailedPrecondition, match=r"^build has not produced an image yet$"):
        await deployer.deploy_build(ENV, "b1")
    build.status = pb.BUILD_STATUS_SUCCEEDED
    build.image_ref = "reg/app@sha256:1"
    build.platforms.append("linux/arm64")
    await writer.commit(writer.txn().put(build))
    created = await deployer.deploy_build(ENV, "b1")
    assert created.release.image_ref == "reg/app@sha256:1" and list(created.release.platforms) == ["linux/arm64"]
    assert created.deployment.build_id == ""  # the image is known: BUILDING is never entered


async def test_source_deploy_creates_a_queued_build_an_imageless_release_and_a_gated_deployment(
    deployer: Deployer, view: StateView
) -> None:
    created = await deployer.deploy_source(ENV, tarball_digest=DIGEST, git_sha="abc", build_type=pb.BUILD_TYPE_NIXPACKS)
    assert created.build is not None
    build = view.build(created.build.meta.id)
    assert build is not None
    assert build.status == pb.BUILD_STATUS_QUEUED and build.tarball_digest == DIGEST and build.git_sha == "abc"
    assert list(build.platforms) == ["linux/arm64"]
    assert created.release.image_ref == "" and created.release.version == 1
    assert created.deployment.build_id == build.meta.id
    assert created.deployment.phase == pb.DEPLOYMENT_PHASE_PENDING


async def test_rollback_preconditions_and_explicit_targets(deployer: Deployer, writer: Writer) -> None:
    with pytest.raises(FailedPrecondition, match=r"^no previous release to roll back to$"):
        await deployer.rollback(ENV)
    first = await deployer.deploy_image(ENV, "nginx:1")
    await finish(writer, first.deployment)
    with pytest.raises(FailedPrecondition, match=r"^no previous release to roll back to$"):
        await deployer.rollback(ENV)
    with pytest.raises(NotFound, match=r"^target release not found in this environment$"):
        await deployer.rollback(ENV, to_release_id="rel-elsewhere")
    explicit = await deployer.rollback(ENV, to_release_id=first.release.meta.id)
    assert explicit.release_id == first.release.meta.id and explicit.previous_release_id == first.release.meta.id


async def test_default_rollback_skips_releases_whose_build_never_produced_an_image(
    deployer: Deployer, writer: Writer
) -> None:
    first = await deployer.deploy_image(ENV, "nginx:1")
    await finish(writer, first.deployment)
    source = await deployer.deploy_source(ENV, tarball_digest=DIGEST)
    await finish(writer, source.deployment, pb.DEPLOYMENT_PHASE_FAILED)
    third = await deployer.deploy_image(ENV, "nginx:3")
    await finish(writer, third.deployment)
    rollback = await deployer.rollback(ENV)
    assert rollback.release_id == first.release.meta.id


async def test_cancel_records_the_request_and_refuses_finished_deployments(
    deployer: Deployer, writer: Writer, view: StateView
) -> None:
    created = await deployer.deploy_image(ENV, "nginx:1")
    requested = await deployer.cancel(created.deployment.meta.id)
    assert requested.error == "canceled by operator" and requested.phase == pb.DEPLOYMENT_PHASE_PENDING
    assert view.deployment(created.deployment.meta.id) == requested
    await finish(writer, created.deployment, pb.DEPLOYMENT_PHASE_FAILED)
    with pytest.raises(FailedPrecondition, match=r"^deployment already finished \(FAILED\)$"):
        await deployer.cancel(created.deployment.meta.id)


def has_deployment(view: StateView, deployment_id: str) -> bool:
    return view.deployment(deployment_id) is not None


def caught_up(racer_views: list[StateView], view: StateView, deployments: int) -> bool:
    return all(v.env(ENV) == view.env(ENV) and len(v.deployments(ENV)) == deployments for v in racer_views)


async def test_concurrent_deploys_never_duplicate_a_version_or_pass_the_blocking_rule(
    nats_url: str, deployer: Deployer, writer: Writer, view: StateView
) -> None:
    """Several API processes (own connection and view each) race to deploy, round after round."""
    racers: list[tuple[Connection, StateView, Deployer]] = []
    for i in range(4):
        c = await connect(nats_url, name=f"api-{i}")
        v = StateView(c, name=f"api-{i}")
        await v.start()
        racers.append((c, v, Deployer(Writer(c, v))))
    try:
        for round_no in range(1, 5):
            racer_views = [v for _, v, _ in racers]
            await eventually(partial(caught_up, racer_views, view, round_no - 1), what="racers saw the last round")
            outcomes = await asyncio.gather(
                *(d.deploy_image(ENV, f"nginx:{round_no}-{i}") for i, (_, _, d) in enumerate(racers)),
                return_exceptions=True,
            )
            winners = [o for o in outcomes if not isinstance(o, BaseException)]
            losers = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(winners) == 1, outcomes
            assert all(isinstance(o, FailedPrecondition) for o in losers), losers
            await eventually(partial(has_deployment, view, winners[0].deployment.meta.id))
            await finish(writer, winners[0].deployment)
        versions = sorted(r.version for r in view.releases(ENV))
        assert versions == [1, 2, 3, 4]
    finally:
        for c, v, _ in racers:
            await v.stop()
            await c.close()


def test_deploy_errors_are_operator_action_refusals_of_their_kind() -> None:
    assert NotFound("x").kind is Refusal.NOT_FOUND
    assert FailedPrecondition("x").kind is Refusal.CONFLICT
    assert InvalidArgument("f", "p").kind is Refusal.INVALID and str(InvalidArgument("f", "p")) == "f: p"
    assert issubclass(InvalidArgument, DeployError) and issubclass(DeployError, ActionRefused)
