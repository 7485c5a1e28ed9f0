"""Canceling a build (shared/actions/builds.py) on real NATS: QUEUED or RUNNING → CANCELED, refused once
it ended or when it does not exist (the dispatcher's side: tests/builds/test_dispatcher.py)."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared.actions.builds import CancelBuild, cancel_build
from shared.actions.context import ActionContext
from shared.actions.refusals import Conflicting, NotFound
from shared.txn import Writer
from tests.builds import seed


async def test_a_queued_build_is_canceled_once(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().create(seed.build("b1")))
    assert (await cancel_build(ctx, CancelBuild("b1"))).build_id == "b1"
    build = ctx.view.build("b1")
    assert build is not None and (build.status, build.error) == (pb.BUILD_STATUS_CANCELED, "canceled")
    with pytest.raises(Conflicting, match=r"^build b1 already ended \(BUILD_STATUS_CANCELED\)$"):
        await cancel_build(ctx, CancelBuild("b1"))
    with pytest.raises(NotFound, match=r"^build nope not found$"):
        await cancel_build(ctx, CancelBuild("nope"))
