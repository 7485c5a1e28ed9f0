"""``zattera deploy promote|abort ID`` (shared/actions/deploys.py, issue 41) on real NATS: the request is
recorded on the deployment with the actor (the orchestrator acts on it), refused of its kind otherwise."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext
from shared.actions.deploys import CanaryDecision, abort_canary, promote_canary
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.txn import Writer
from tests.actions.conftest import ACTOR, ENV_ID, named


def canary_deployment(phase: int = pb.DEPLOYMENT_PHASE_CANARY) -> pb.Deployment:
    d = pb.Deployment(environment_id=ENV_ID, release_id="01REL2", previous_release_id="01REL1", phase=phase)  # type: ignore[arg-type]
    d.meta.id = "01DEP"
    d.canary.step, d.canary.weight = 1, 25
    return d


async def test_promote_is_recorded_with_the_actor_once(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=[*named(), canary_deployment()]))
    done = await promote_canary(ctx, CanaryDecision("01DEP"))
    assert (done.requested, done.step, done.weight) == ("promote", 1, 25)
    record = ctx.view.deployment("01DEP")
    assert record is not None and (record.canary.requested, record.canary.requested_by) == ("promote", ACTOR)
    again = await promote_canary(ctx, CanaryDecision("01DEP"))  # idempotent
    assert again.requested == "promote"
    with pytest.raises(Conflicting, match="promote already requested by tester"):
        await abort_canary(ctx, CanaryDecision("01DEP"))


async def test_abort_refusals_name_their_cause(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=[*named(), canary_deployment(pb.DEPLOYMENT_PHASE_HEALTHCHECKING)]))
    with pytest.raises(Invalid, match=r"^deployment_id: must not be empty$"):
        await abort_canary(ctx, CanaryDecision(" "))
    with pytest.raises(NotFound) as missing:
        await abort_canary(ctx, CanaryDecision("01NOPE"))
    assert missing.value.field == "deployment_id"
    with pytest.raises(Conflicting, match=r"not in a canary step \(HEALTHCHECKING\)"):
        await abort_canary(ctx, CanaryDecision("01DEP"))
