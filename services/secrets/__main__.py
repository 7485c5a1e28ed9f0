"""Entry point: `python -m services.secrets [--nats URL]`.

Every replica answers agents' secrets requests and rotations (queue group); replicas share the key file. The
collector of unused secret versions runs in the holder of ``lease.secrets-gc``, the scheduled backups in the
holder of ``lease.backups``, the off-site copies of volume snapshots in the holder of
``lease.snapshot-offsite``, the notifications in the holder of ``lease.notify``, the log drains in the
holder of ``lease.drains``, the git hooks' deploys, previews and commit statuses in the holder of
``lease.githooks`` (every replica verifies and queues webhook deliveries: docs/git.md).
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from zattera.v1 import types_pb2 as pb

from services.secrets.backups import ScheduledBackups
from services.secrets.collector import SecretsCollector
from services.secrets.delivery import DeliverySettings
from services.secrets.drains import Drainer, DrainSettings
from services.secrets.githook_gate import HookGate
from services.secrets.githooks import GitHooks, GitHooksSettings
from services.secrets.notify import Notifier
from services.secrets.offsite import OffsiteSnapshots
from services.secrets.service import SecretsService
from services.secrets.settings import SecretsSettings
from shared import keys as K
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
    offsite = OffsiteSnapshots(ctx.loop_deps, lambda: service.keyring)
    notifier = Notifier(ctx.loop_deps, lambda: service.keyring, settings=DeliverySettings.of(cfg, "notify"))
    drainer = Drainer(ctx.loop_deps, lambda: service.keyring, settings=DrainSettings.of(cfg, "drain"))
    gate = HookGate(ctx.conn, lambda hook_id: _hook(ctx, hook_id), lambda: service.keyring)
    githooks = GitHooks(ctx.loop_deps, lambda: service.keyring, settings=GitHooksSettings(domain=ctx.settings.domain))
    return [
        service.run(),
        ctx.lead(collector),
        ctx.lead(backups),
        ctx.lead(offsite),
        ctx.lead(notifier),
        ctx.lead(drainer),
        gate.serve(),
        ctx.lead(githooks),
    ]


def _hook(ctx: ServiceContext, hook_id: str) -> pb.GitHook | None:
    found = ctx.view.get(K.GIT_HOOK, hook_id)
    return found if isinstance(found, pb.GitHook) else None


if __name__ == "__main__":
    main("secrets", build)
