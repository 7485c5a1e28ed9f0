"""Canceling a build (``zattera builds cancel <id>``): QUEUED or RUNNING → CANCELED.

The write is a compare-and-set on the build's revision, so it never overwrites an outcome the
dispatcher recorded meanwhile. The dispatcher sees the CANCELED build and tells its builder to stop
(``zattera.agent.<node>.build.cancel``); a QUEUED build is simply never claimed.
"""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext, commit
from shared.actions.refusals import Conflicting, NotFound
from shared.buildlogs import TERMINAL_STATUSES
from shared.clock import stamp
from shared.retry import Attempt

CANCELED_ERROR = "canceled"


@dataclass(frozen=True, slots=True)
class CancelBuild:
    build_id: str


@dataclass(frozen=True, slots=True)
class BuildCanceled:
    build_id: str


def canceled_build(build: pb.Build, now: float) -> pb.Build:
    b = pb.Build()
    b.CopyFrom(build)
    b.status = pb.BUILD_STATUS_CANCELED
    b.error = CANCELED_ERROR
    stamp(b.finished_at, now)
    return b


async def cancel_build(ctx: ActionContext, request: CancelBuild) -> BuildCanceled:
    """Cancel a build; refused when it does not exist or already ended."""
    build_id = request.build_id

    def decide() -> Attempt[pb.Build]:
        build = ctx.view.build(build_id)
        if build is None:
            raise NotFound(f"build {build_id} not found", field="build_id")
        if build.status in TERMINAL_STATUSES:
            status = pb.BuildStatus.Name(build.status)
            raise Conflicting(f"build {build_id} already ended ({status})", field="build_id")
        canceled = canceled_build(build, ctx.clock.now())
        return Attempt(ctx.writer.txn("cancel build").put(canceled), canceled)

    def landed(canceled: pb.Build) -> bool:
        return ctx.view.build(build_id) == canceled

    await commit(ctx, decide, contended=f"build {build_id}", landed=landed)
    return BuildCanceled(build_id)
