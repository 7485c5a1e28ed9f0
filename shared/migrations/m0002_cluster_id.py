"""Migration 0002: a cluster id for clusters initialised before ids were recorded.

Route snapshots name the cluster they were built from by its id and its state stream's creation time
(docs/wire-contract.md §4); a new cluster records an id at its init. One made by 0.1.0 had none: it gets
one here, so that every cluster has the same record. The first snapshot named by it replaces what proxies
cached under no id, whatever its version, as after any change of identity.
"""

from __future__ import annotations

import dataclasses

from shared.ids import new_id
from shared.migrations.base import Migration, MigrationContext


async def apply(ctx: MigrationContext) -> None:
    if ctx.config.cluster_id:  # recorded at init, or by this migration's run that was cut before the next
        return
    ctx.config = dataclasses.replace(ctx.config, cluster_id=new_id())
    ctx.changed(f"recorded the cluster id {ctx.config.cluster_id}")


MIGRATION = Migration(
    summary="a cluster id recorded for a cluster initialised before ids were (route snapshots name it)",
    release="0.2.0",
    apply=apply,
)
