"""Migration 0004: the audit log's stream (docs/audit.md).

``ZATTERA_AUDIT`` holds one entry per operator write; a cluster initialised before it existed gets it here,
with the recorded replica count and the default retention (90 days: the init is what takes
``ZATTERA_AUDIT_MAX_AGE``, docs/audit.md says how to change it later).
"""

from __future__ import annotations

from shared.migrations.base import Migration, MigrationContext
from shared.streams import audit_stream_config


async def apply(ctx: MigrationContext) -> None:
    await ctx.create_stream(audit_stream_config(ctx.config.replicas, ctx.config.audit_max_age))


MIGRATION = Migration(
    summary="the audit log's stream ZATTERA_AUDIT (append-only, entries kept 90 days)",
    release="0.2.0",
    apply=apply,
)
