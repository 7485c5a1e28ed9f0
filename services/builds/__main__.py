"""Entry point: `python -m services.builds [--nats URL]`."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    return []


if __name__ == "__main__":
    main("builds", build)
