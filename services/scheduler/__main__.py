"""Entry point: `python -m services.scheduler [--nats URL]`.

Runs the placement loop (``lease.scheduler``), node liveness (``lease.liveness``), the snapshot scheduler
(``lease.snapshots``) and the jobs loop (``lease.jobs``), each only while this replica holds its lease.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.scheduler.jobs import JobsLoop
from services.scheduler.liveness import TICK as LIVENESS_TICK
from services.scheduler.liveness import Liveness
from services.scheduler.loop import Scheduler
from services.scheduler.settings import SchedulerSettings
from services.scheduler.snapshots import SnapshotScheduler
from shared.live import LiveView
from shared.service import ServiceContext, main
from shared.snapshots.dispatch import SnapshotDispatcher
from shared.snapshots.guards import snapshot_target


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    own = SchedulerSettings()
    live = LiveView(ctx.conn, ctx.clock)
    await live.start()
    return [
        ctx.lead(Scheduler(ctx.loop_deps, tick=ctx.settings.loop_tick)),
        ctx.lead(
            Liveness(
                ctx.loop_deps,
                live=live,
                tick=min(LIVENESS_TICK, ctx.settings.loop_tick),
                deadline=own.node_heartbeat_deadline,
                grace=own.liveness_grace,
            )
        ),
        ctx.lead(JobsLoop(ctx.loop_deps, tick=ctx.settings.loop_tick)),
        ctx.lead(
            SnapshotScheduler(
                ctx.loop_deps,
                dispatcher=SnapshotDispatcher(ctx.conn, ctx.view, ctx.clock, target=snapshot_target(ctx.settings)),
                restore_timeout=ctx.settings.restore_timeout,
            )
        ),
    ]


if __name__ == "__main__":
    main("scheduler", build)
