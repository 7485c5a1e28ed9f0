"""Migration 0003: private-network VIPs move from 10.97.0.0/16 to the loopback range 127.128.0.0/16.

A VIP of 10.97/16 looked like an address an app could use, and a connection to it left the machine for
whatever real network holds that range (docs/networking.md). Each ``vip.<env_id>`` held in 10.97.a.b is
rewritten to 127.128.a.b: the host part ``a.b`` is kept, so every app's address of an env
(``127.(128+c).a.b``) and every name's answer stay the same, and running instances need no restart. The
previous release's forwarders read only that host part, so they serve the rewritten VIPs unchanged.
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared.migrations.base import Migration, MigrationContext

EARLIER_PREFIX = "10.97."
LOOPBACK_PREFIX = "127.128."


def moved(vip: str) -> str | None:
    """The loopback VIP a VIP of the earlier range becomes (None: it is not of that range)."""
    return LOOPBACK_PREFIX + vip[len(EARLIER_PREFIX) :] if vip.startswith(EARLIER_PREFIX) else None


async def apply(ctx: MigrationContext) -> None:
    view, writer = await ctx.state()
    rewrites = [(vip.environment_id, new) for vip in view.vips() if (new := moved(vip.vip)) is not None]
    if not rewrites:
        return
    txns = [writer.txn("vip.loopback").put(pb.ServiceVIP(environment_id=env_id, vip=new)) for env_id, new in rewrites]
    failed = [result for result in await writer.commit_many(txns) if result is not None]
    if failed:  # the allocator changed one meanwhile: the migration fails and its next run (idempotent) finishes
        raise failed[0]
    ctx.changed(f"moved {len(rewrites)} VIPs from 10.97.0.0/16 to 127.128.0.0/16 (host parts kept)")


MIGRATION = Migration(
    summary="private-network VIPs move from 10.97.0.0/16 to the loopback 127.128.0.0/16 (host parts kept)",
    release="0.2.0",
    apply=apply,
)
