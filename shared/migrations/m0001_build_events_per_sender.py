"""Migration 0001: what clusters made before schemas were recorded lack (0.1.0 and the builds before it).

* ``ZATTERA_BUILD_EVENTS`` captures ``zattera.builds.<build>.events.<node>``: build events name their sender
  (a builder may publish only under its own node id). Clusters made before that captured
  ``zattera.builds.*.events`` and refused every builder's publish (every build failed "builder lost").
* ``KV_zattera-live`` refuses rollup headers: agents and proxies write there, and a rollup from one would
  wipe every other key.
* The cluster configuration is recorded on the state stream (replicas, TTLs, build-log lines, when), read
  from the streams as they are for a cluster that never recorded it.

On a cluster made by 0.1.0 only the record is new.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.migrations.base import Migration, MigrationContext
from shared.provisioning import js_api, raw_stream_config
from shared.streams import BUILD_LOG_END_SLOTS
from shared.subjects import BUILD_EVENTS_STREAM, BUILD_LOGS_STREAM, LIVE_STREAM, STATE_STREAM

BUILD_EVENTS_SUBJECTS = ["zattera.builds.*.events.*"]
NANOS = 1_000_000_000


def per_sender(config: dict[str, Any]) -> None:
    config["subjects"] = list(BUILD_EVENTS_SUBJECTS)


def no_rollups(config: dict[str, Any]) -> None:
    config["allow_rollup_hdrs"] = False


async def apply(ctx: MigrationContext) -> None:
    await ctx.edit_stream(BUILD_EVENTS_STREAM, per_sender)
    await ctx.edit_stream(LIVE_STREAM, no_rollups)
    if ctx.config.initialized_at:
        return
    # Never recorded: the configuration the streams were made with is the one to record.
    live = await raw_stream_config(ctx.conn.nc, LIVE_STREAM)
    logs = await raw_stream_config(ctx.conn.nc, BUILD_LOGS_STREAM)
    created = str((await js_api(ctx.conn.nc, f"STREAM.INFO.{STATE_STREAM}")).get("created", ""))
    ctx.config = dataclasses.replace(
        ctx.config,
        live_ttl=(live or {}).get("max_age", 0) / NANOS or ctx.config.live_ttl,
        build_log_lines=max(1, (logs or {}).get("max_msgs_per_subject", 0) - BUILD_LOG_END_SLOTS)
        if logs
        else ctx.config.build_log_lines,
        initialized_at=created[:19] + "+00:00" if created else "",
    )
    ctx.changed(
        f"recorded the configuration: replicas={ctx.config.replicas}, live_ttl={ctx.config.live_ttl:g}s, "
        f"tombstone_ttl={ctx.config.tombstone_ttl:g}s, build_log_lines={ctx.config.build_log_lines}"
    )


MIGRATION = Migration(
    summary="build events per sender (ZATTERA_BUILD_EVENTS subjects), no rollups on KV_zattera-live, "
    "the cluster configuration recorded",
    release="0.2.0",
    apply=apply,
)
