"""One-off commands and job cancels (shared/actions/jobs.py) on real NATS: what each refuses, naming the
field, and the cancel recorded as the actor's."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared import jobs as J
from shared import keys as K
from shared.actions.context import ActionContext
from shared.actions.jobs import CancelJob, RunJob, cancel_job, run_job
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.txn import Writer
from tests.actions.conftest import ACTOR, ENV_ID, PATH, named


async def test_run_needs_an_active_release_and_a_command_it_can_carry(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    with pytest.raises(Conflicting) as refused:
        await run_job(ctx, RunJob(PATH, "echo hi"))
    assert refused.value.field == "env"
    assert (
        refused.value.said_as({"env": "--env"}) == f"--env: {PATH} has no active release yet (`zattera deploy` first)"
    )
    with pytest.raises(Invalid) as bad:
        await run_job(ctx, RunJob(PATH, "x" * (J.MAX_COMMAND_BYTES + 1)))
    assert bad.value.field == "command" and "over the 4096-byte limit" in str(bad.value)


async def test_run_writes_a_pending_job_and_cancel_records_the_actor(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=named(active_release_id="rel1")))
    started = await run_job(ctx, RunJob(PATH, "echo hi"))
    assert (started.env_id, started.env) == (ENV_ID, PATH)
    job = ctx.view.get(K.JOB, started.job_id)
    assert isinstance(job, pb.Job) and (job.status, job.command) == (J.PENDING, "echo hi")

    with pytest.raises(NotFound, match="not found in env 01OTHER"):
        await cancel_job(ctx, CancelJob(started.job_id, env_id="01OTHER"))
    await cancel_job(ctx, CancelJob(started.job_id, env_id=ENV_ID))
    canceling = ctx.view.get(K.JOB, started.job_id)
    assert isinstance(canceling, pb.Job) and canceling.cancel_requested
    assert canceling.message == f"canceled by {ACTOR}"
    revision = ctx.view.rev(K.job(started.job_id))
    await cancel_job(ctx, CancelJob(started.job_id))  # asked again: nothing more to write
    assert ctx.view.rev(K.job(started.job_id)) == revision


async def test_a_job_that_ended_or_does_not_exist_is_refused_naming_the_job(ctx: ActionContext, writer: Writer) -> None:
    done = pb.Job(environment_id=ENV_ID, status=J.SUCCEEDED)
    done.meta.id = "01JOBDONE"
    await writer.commit(writer.txn().extend(creates=[*named(), done]))
    with pytest.raises(Conflicting) as ended:
        await cancel_job(ctx, CancelJob("01JOBDONE"))
    assert ended.value.said_as({"job_id": "JOB_ID"}) == "JOB_ID: job 01JOBDONE already ended (succeeded)"
    assert str(ended.value) == "job 01JOBDONE already ended (succeeded)"
    with pytest.raises(NotFound, match=r"^no job '01JNOPE' \(see `zattera jobs list`\)$"):
        await cancel_job(ctx, CancelJob("01JNOPE"))
    with pytest.raises(Invalid, match=r"job id '\.\./x' is not"):
        await cancel_job(ctx, CancelJob("../x"))
