"""Configuration changes, deploys, rollbacks and cancels (shared/actions/config.py, secrets.py, deploys.py)
on real NATS: staged or rolled out, the actor recorded on the deployment, refusals of their kind."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared.actions.config import ChangeVars, change_vars
from shared.actions.context import ActionContext
from shared.actions.deploys import CancelDeployment, Deploy, Rollback, cancel_deployment, deploy, rollback
from shared.actions.refusals import Conflicting, Invalid, NotFound, Refusal
from shared.actions.secrets import SetSecret, UnsetSecrets, set_secret, unset_secrets
from shared.txn import Writer
from tests import factories
from tests.actions.conftest import ACTOR, ENV_ID, PATH, named
from tests.console.rig import cluster_key, random_secret


async def test_vars_are_staged_before_the_first_deploy_and_refused_naming_the_field(
    ctx: ActionContext, writer: Writer
) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    done = await change_vars(ctx, ChangeVars(PATH, {"GREETING": "hi"}))
    assert (done.env_id, done.env, done.config_version, done.deployment_id, done.deployed) == (
        ENV_ID,
        PATH,
        1,
        "",
        False,
    )
    with pytest.raises(Invalid, match=r"^vars.NOPE: not set on this environment$"):
        await change_vars(ctx, ChangeVars(PATH, {"NOPE": None}))
    with pytest.raises(Invalid, match=r"^vars.PORT: 'PORT' is reserved"):
        await change_vars(ctx, ChangeVars(PATH, {"PORT": "1"}))


async def test_a_change_to_a_running_env_rolls_out_a_release_created_by_the_actor(
    ctx: ActionContext, writer: Writer
) -> None:
    release = factories.release("01REL1", ENV_ID)
    await writer.commit(writer.txn().extend(creates=[*named(active_release_id="01REL1"), release, cluster_key()]))
    value = random_secret()
    done = await set_secret(ctx, SetSecret(PATH, "API_TOKEN", value))
    assert done.deployed and done.release_version == 2 and done.deployment_id
    deployment = ctx.view.deployment(done.deployment_id)
    assert deployment is not None and deployment.created_by_user_id == ACTOR
    assert value not in repr(SetSecret(PATH, "API_TOKEN", value)), "a request never shows its value"
    assert all(value.encode() not in s.ciphertext for s in ctx.view.secrets(ENV_ID))
    with pytest.raises(Conflicting, match="a deployment is already in progress"):
        await unset_secrets(ctx, UnsetSecrets(PATH, ["API_TOKEN"]))
    staged = await unset_secrets(ctx, UnsetSecrets(PATH, ["API_TOKEN"], deploy=False))
    assert staged.deployment_id == "" and staged.deployed


async def test_deploy_rollback_and_cancel_are_refused_of_their_kind(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    with pytest.raises(NotFound) as missing:
        await deploy(ctx, Deploy("shop/web/nope", image_ref="img:1"))
    assert missing.value.field == "env"
    with pytest.raises(Invalid, match=r"^image_ref: must not contain whitespace$"):
        await deploy(ctx, Deploy(PATH, image_ref="img 1"))
    created = await deploy(ctx, Deploy(PATH, image_ref="img:1"))
    assert (created.env, created.release_version) == (PATH, 1)
    with pytest.raises(Conflicting) as busy:
        await deploy(ctx, Deploy(PATH, image_ref="img:2"))
    assert busy.value.kind is Refusal.CONFLICT
    canceled = await cancel_deployment(ctx, CancelDeployment(created.deployment_id))
    assert canceled.phase == "PENDING"
    record = ctx.view.deployment(created.deployment_id)
    assert record is not None and record.error == "canceled by operator"
    with pytest.raises(Conflicting, match="a deployment is already in progress"):  # until the orchestrator fails it
        await rollback(ctx, Rollback(PATH))


async def test_rollback_goes_to_the_release_below_the_active_one(ctx: ActionContext, writer: Writer) -> None:
    old, new = factories.release("01REL1", ENV_ID, version=1), factories.release("01REL2", ENV_ID, version=2)
    await writer.commit(writer.txn().extend(creates=[*named(active_release_id="01REL2"), old, new]))
    done = await rollback(ctx, Rollback(ENV_ID))
    assert (done.release_id, done.release_version, done.env) == ("01REL1", 1, PATH)
    deployment = ctx.view.deployment(done.deployment_id)
    assert deployment is not None and deployment.is_rollback and deployment.phase == pb.DEPLOYMENT_PHASE_PENDING
