"""Entry point: `python -m services.routes [--nats URL]`.

Every replica builds, publishes and serves route snapshots (not leader-gated: they all publish the same
bytes for the same state); the VIP allocator runs in the holder of ``lease.vips`` only.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.routes.publisher import RoutesPublisher
from services.routes.vips import VipAllocator
from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    publisher = RoutesPublisher(ctx.conn, ctx.view, domain=ctx.settings.domain, clock=ctx.clock)
    vips = VipAllocator(ctx.loop_deps, tick=ctx.settings.loop_tick)
    return [publisher.run(), ctx.lead(vips)]


if __name__ == "__main__":
    main("routes", build)
