"""Entry point: `python -m services.builds [--nats URL]`: build dispatcher, retention (with the
registry sweeper) and the instance-log streams, each under its own lease."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.builds.dispatcher import BuildDispatcher
from services.builds.logstreams import LogStreams
from services.builds.planning import BuildDispatcherConfig
from services.builds.registry import RegistrySweeper
from services.builds.retention import Retention
from services.builds.settings import BuildsSettings
from shared.applogs import LogLimits
from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    cfg = BuildsSettings()
    dispatcher = BuildDispatcher(
        ctx.loop_deps,
        config=BuildDispatcherConfig.of(cfg),
        tick=ctx.settings.loop_tick,
    )
    retention = Retention(
        ctx.loop_deps,
        sweeper=RegistrySweeper(ctx.conn, ctx.view, ctx.clock, grace=cfg.blob_grace),
        interval=cfg.retention_interval,
        keep=cfg.keep_releases,
        source_max_age=cfg.source_max_age,
    )
    log_streams = LogStreams(
        ctx.loop_deps,
        default=LogLimits(ctx.settings.logs_max_bytes, ctx.settings.logs_max_age),
        replicas=ctx.settings.replicas,
        tick=ctx.settings.loop_tick,
    )
    return [ctx.lead(dispatcher), ctx.lead(retention), ctx.lead(log_streams)]


if __name__ == "__main__":
    main("builds", build)
