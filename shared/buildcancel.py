"""Operator cancel of a build (``zattera builds cancel <id>``): QUEUED or RUNNING → CANCELED.

The write is a compare-and-set on the build's revision, so it never overwrites an outcome the
dispatcher recorded meanwhile. The dispatcher sees the CANCELED build and tells its builder to stop
(``zattera.agent.<node>.build.cancel``); a QUEUED build is simply never claimed.
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared.buildlogs import TERMINAL_STATUSES
from shared.clock import Clock, stamp
from shared.errors import ZatteraError
from shared.retry import Attempt, RetriesExhausted, commit_with_retry
from shared.txn import Writer

CANCELED_ERROR = "canceled"


class CancelRefused(ZatteraError):
    pass


def canceled_build(build: pb.Build, now: float) -> pb.Build:
    b = pb.Build()
    b.CopyFrom(build)
    b.status = pb.BUILD_STATUS_CANCELED
    b.error = CANCELED_ERROR
    stamp(b.finished_at, now)
    return b


async def cancel_build(writer: Writer, build_id: str, *, clock: Clock) -> pb.Build:
    """Cancel a build; raises :class:`CancelRefused` when it does not exist or already ended."""
    view = writer.view

    def decide() -> Attempt[pb.Build]:
        build = view.build(build_id)
        if build is None:
            raise CancelRefused(f"build {build_id} not found")
        if build.status in TERMINAL_STATUSES:
            raise CancelRefused(f"build {build_id} already ended ({pb.BuildStatus.Name(build.status)})")
        canceled = canceled_build(build, clock.now())
        return Attempt(writer.txn("cancel build").put(canceled), canceled)

    def landed(canceled: pb.Build) -> bool:
        return view.build(build_id) == canceled

    try:
        return await commit_with_retry(writer, decide, clock=clock, contended=f"build {build_id}", landed=landed)
    except RetriesExhausted as exc:
        raise CancelRefused(str(exc)) from None
