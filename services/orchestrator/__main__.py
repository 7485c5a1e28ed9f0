"""Entry point: `python -m services.orchestrator [--nats URL]`."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.orchestrator.loop import Orchestrator
from services.orchestrator.model import Timers
from services.orchestrator.settings import OrchestratorSettings
from shared.live import LiveView
from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    timers = Timers.from_settings(ctx.settings, OrchestratorSettings())
    live = LiveView(ctx.conn, ctx.clock)  # the proxies' in-flight counts: a drain ends with the work
    await live.start()
    loop = Orchestrator(ctx.loop_deps, timers=timers, tick=ctx.settings.loop_tick, live=live)
    return [ctx.lead(loop)]


if __name__ == "__main__":
    main("orchestrator", build)
