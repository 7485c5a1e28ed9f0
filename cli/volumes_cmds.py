"""``zattera volumes list|policy|snapshots|snapshot|restore``: volumes and their snapshots; setting a policy,
snapshotting and restoring are operator actions (:mod:`shared.actions.volumes`)."""

from __future__ import annotations

from collections import Counter

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import ExitCode, control, err, fail, on_cluster, run, say
from cli.options import JSON, WIDE, set_output
from cli.render import Col
from shared.actions.names import env_label
from shared.actions.refusals import ActionRefused
from shared.actions.volumes import (
    RestoreVolume,
    SetSnapshotPolicy,
    SnapshotTaken,
    TakeSnapshot,
    restore_volume,
    set_snapshot_policy,
    take_snapshot,
)
from shared.backup.targets import credentials_from_environment

volumes_app = typer.Typer(no_args_is_help=True, help="Volumes and their snapshots.")


@volumes_app.command("list")
def volumes_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Volumes, their pinned node and their snapshots."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            snapshots = Counter(s.volume_id for s in c.view.snapshots())
            render.listing(
                "volumes",
                ["id", "name", "env", "node", "status", "schedule", "snapshots"],
                c.view.volumes(),
                lambda v: [
                    v.meta.id,
                    v.name,
                    env_label(c.view, v.environment_id),
                    v.node_id,
                    render.enum_name(pb.VolumeStatus, v.status, "VOLUME_STATUS_"),
                    v.snapshot_policy.schedule or "-",
                    snapshots[v.meta.id],
                ],
            )

    run(go)


@volumes_app.command("policy")
def volumes_policy(
    volume_id: str = typer.Argument(..., help="volume id (see `zattera volumes list`)"),
    schedule: str | None = typer.Option(
        None, "--schedule", help='cron, 5 fields in UTC (CRON_TZ=Zone prefix, @daily, @every 6h); "" = manual only'
    ),
    keep_last: int | None = typer.Option(
        None, "--keep-last", min=0, max=1000, help="COMPLETE snapshots kept (here and off-site); 0 = 7"
    ),
    pre_hook: str | None = typer.Option(
        None, "--pre-hook", help='shell command run in the instance before each snapshot; "" = none'
    ),
    offsite: str | None = typer.Option(
        None,
        "--offsite",
        metavar="TARGET",
        help="copy each snapshot to a directory or s3://bucket/prefix (AWS_* settings from the environment, "
        'stored sealed); "" = stop copying',
    ),
    json: bool = JSON,
) -> None:
    """Set a volume's snapshot policy (only the options given change; `apps apply` uses the same code)."""
    set_output(json)
    settings = credentials_from_environment() if offsite and offsite.startswith("s3://") else {}
    request = SetSnapshotPolicy(volume_id, schedule, keep_last, pre_hook, offsite, settings)

    done = on_cluster(set_snapshot_policy, request)
    if render.json_mode():
        render.emit_json(
            {
                "schedule": done.schedule,
                "keep_last": done.keep_last,
                "pre_hook": done.pre_hook,
                "offsite": done.offsite,
                "offsite_settings": done.offsite_settings,
            }
        )
        return
    stored = f" (settings stored sealed: {', '.join(done.offsite_settings)})" if done.offsite_settings else ""
    err.print(
        f"volume {done.name} ({volume_id}): schedule {done.schedule or '(manual only)'}, "
        f"keep last {done.keep_last or 7}, pre-hook {done.pre_hook or '(none)'}, "
        f"off-site {done.offsite or '(none)'}{stored}",
        markup=False,
        highlight=False,
    )


@volumes_app.command("snapshots")
def volumes_snapshots(
    volume_id: str = typer.Argument(..., help="volume id (see `zattera volumes list`)"),
    json: bool = JSON,
    wide: bool = WIDE,
) -> None:
    """A volume's snapshot records, newest first: the ids `zattera volumes restore` takes."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            volume = c.view.volume(volume_id)
            records = [s for s in c.view.snapshots() if s.volume_id == volume_id]
            if volume is None and not records:
                raise fail(f"volume {volume_id!r} not found")
            records.sort(key=lambda s: (s.meta.created_at.ToNanoseconds(), s.meta.id), reverse=True)
            render.listing(
                f"snapshots of volume {volume.name if volume else '(deleted)'} ({volume_id})",
                ["id", "state", "created", "size", "uploaded", Col("error", wrap=True)],
                records,
                lambda s: [
                    s.meta.id,
                    render.enum_name(pb.SnapshotStatus, s.status, "SNAPSHOT_STATUS_"),
                    render.ts(s.meta.created_at),
                    f"{s.logical_size_bytes:,} B",
                    f"{s.uploaded_bytes:,} B",
                    s.error,
                ],
            )

    run(go)


@volumes_app.command("snapshot")
def volumes_snapshot(volume_id: str) -> None:
    """Snapshot a volume now (on its node), and wait for the result."""

    async def go() -> SnapshotTaken:
        async with control() as c:
            volume = c.view.volume(volume_id)
            if volume is None:
                raise fail(f"volume {volume_id!r} not found")
            err.print(f"snapshotting volume {volume.name} on node {volume.node_id} …")
            try:
                return await take_snapshot(c.actions, TakeSnapshot(volume_id))
            except ActionRefused as exc:
                raise fail(f"snapshot failed: {exc}") from None

    done = run(go)
    err.print(
        f"snapshot {done.snapshot_id}: {done.status.lower()}, {done.logical_size_bytes:,} bytes, "
        f"{done.uploaded_bytes:,} uploaded {done.error}"
    )
    if done.status != "COMPLETE":
        raise typer.Exit(ExitCode.FAILED)


@volumes_app.command("restore")
def volumes_restore(
    volume_id: str = typer.Argument(..., help="volume id (see `zattera volumes list`)"),
    snapshot_id: str = typer.Argument(
        "", help="snapshot id (`volumes snapshots VOL`); with --from: default the newest"
    ),
    source: str = typer.Option(
        "",
        "--from",
        metavar="TARGET",
        help="fetch the snapshot from its off-site target first (a directory or s3://bucket/prefix; AWS_* "
        "settings from the environment)",
    ),
    json: bool = JSON,
) -> None:
    """Rebuild a volume from a COMPLETE snapshot (ids: `volumes snapshots VOL`), or from its off-site copy
    when the local snapshot store lost it (--from); not while mounted or restoring."""
    set_output(json)
    settings = credentials_from_environment() if source.startswith("s3://") else {}
    request = RestoreVolume(volume_id, snapshot_id, source=source, settings=settings)
    done = on_cluster(restore_volume, request, what="restore refused or failed")
    if render.json_mode():
        render.emit_json(
            {"volume_id": done.volume_id, "snapshot_id": done.snapshot_id, "fetched_bytes": done.fetched_bytes}
        )
        return
    fetched = f" ({done.fetched_bytes:,} bytes fetched from {source})" if source else ""
    say(f"volume {volume_id} restored from snapshot {done.snapshot_id}{fetched}")
