"""Entry point: `python -m services.console [--nats URL]`: the web console (docs/console.md).

It listens on ``ZATTERA_CONSOLE_HOST``:``ZATTERA_CONSOLE_PORT`` (127.0.0.1:8090), reads through its state
view and writes through the same fenced paths as the CLI, with the process's own NATS credential (never
sent to a browser). Users: ``zattera console add-user``.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.console.server import serve_console
from services.console.settings import ConsoleSettings
from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    cache_dir = ctx.settings.data_dir / "console"
    cache_dir.mkdir(parents=True, exist_ok=True)
    return [serve_console(ctx.conn, ctx.view, ctx.writer(), ctx.clock, ConsoleSettings(), cache_dir)]


if __name__ == "__main__":
    main("console", build)
