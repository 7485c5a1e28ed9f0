"""Entry point: `python -m services.secrets [--nats URL]`.

Every replica answers agents' secrets requests and rotations (queue group); replicas share the key file. The
collector of unused secret versions runs in the holder of ``lease.secrets-gc``, the scheduled backups in the
holder of ``lease.backups``.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.secrets.backups import ScheduledBackups
from services.secrets.collector import SecretsCollector
from services.secrets.service import SecretsService
from services.secrets.settings import SecretsSettings
from shared import localca
from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    cfg = SecretsSettings()
    service = SecretsService(
        ctx.conn,
        ctx.view,
        ctx.writer(),
        keyring_path=cfg.keyring_path(ctx.settings.data_dir),
        seed_key=cfg.key.get_secret_value(),
        open_wait=cfg.open_wait,
    )
    collector = SecretsCollector(ctx.loop_deps, tick=ctx.settings.loop_tick, grace=cfg.gc_grace)
    backups = ScheduledBackups(
        ctx.loop_deps, lambda: service.keyring, local_ca_dir=localca.directory(ctx.settings.data_dir)
    )
    return [service.run(), ctx.lead(collector), ctx.lead(backups)]


if __name__ == "__main__":
    main("secrets", build)
