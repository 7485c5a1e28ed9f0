"""Entry point: `python -m services.autoscale [--nats URL]`.

One process runs the three scaling loops (each under its own lease, so replicas of this service split
or share them) and the activator responder (every replica answers, not leader-gated), all reading one
:class:`LiveView` over ``zattera-live``.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.autoscale.activator import Activator
from services.autoscale.autoscaler import Autoscaler
from services.autoscale.history import HistoryRecorder
from services.autoscale.scaletozero import ScaleToZero
from services.autoscale.serverless import Serverless
from services.autoscale.settings import AutoscaleSettings
from shared.live import LiveView
from shared.loop import LoopDeps
from shared.service import ServiceContext, main
from shared.settings import Settings


def scaling_loops(
    shared: Settings, own: AutoscaleSettings, live: LiveView, deps: LoopDeps
) -> tuple[Autoscaler, ScaleToZero, Serverless]:
    """The three scaling loops, with their timers from the settings (``ZATTERA_*``)."""
    return (
        Autoscaler(deps, live=live, tick=shared.loop_tick),
        ScaleToZero(deps, live=live, tick=shared.loop_tick, default_idle_timeout=own.scale_to_zero_idle_timeout),
        Serverless(deps, live=live, tick=own.serverless_tick, scale_down_window=own.serverless_scale_down_window),
    )


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    live = LiveView(ctx.conn, ctx.clock)
    await live.start()
    loops = scaling_loops(ctx.settings, AutoscaleSettings(), live, ctx.loop_deps)
    activator = Activator(conn=ctx.conn, view=ctx.view, writer=ctx.writer(), clock=ctx.clock)
    recorder = HistoryRecorder(ctx.loop_deps, live=live)  # metrics history (docs/observability.md)
    return [*(ctx.lead(loop) for loop in loops), activator.serve(), ctx.lead(recorder)]


if __name__ == "__main__":
    main("autoscale", build)
