"""Operator cancel of a build (``zattera builds cancel <id>``): QUEUED or RUNNING → CANCELED.

The write is a compare-and-set on the build's revision, so it never overwrites an outcome the
dispatcher recorded meanwhile. The dispatcher sees the CANCELED build and tells its builder to stop
(``zattera.agent.<node>.build.cancel``); a QUEUED build is simply never claimed.
"""

from __future__ import annotations

import asyncio

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.buildlogs import TERMINAL_STATUSES
from shared.clock import Clock, stamp
from shared.errors import ZatteraError
from shared.txn import CommitUnknown, Conflict, Writer

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


async def cancel_build(writer: Writer, build_id: str, *, clock: Clock, attempts: int = 10) -> pb.Build:
    """Cancel a build; raises :class:`CancelRefused` when it does not exist or already ended."""
    view = writer.view
    for _ in range(attempts):
        build = view.build(build_id)
        if build is None:
            raise CancelRefused(f"build {build_id} not found")
        if build.status in TERMINAL_STATUSES:
            raise CancelRefused(f"build {build_id} already ended ({pb.BuildStatus.Name(build.status)})")
        canceled = canceled_build(build, clock.now())
        rev = view.rev(K.build(build_id))
        try:
            await writer.commit(writer.txn("cancel build").put(canceled))
            return canceled
        except (Conflict, CommitUnknown):
            for _ in range(200):
                if view.rev(K.build(build_id)) != rev:
                    break
                await asyncio.sleep(0.01)
    raise CancelRefused(f"build {build_id} kept changing; try again")
