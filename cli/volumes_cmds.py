"""``zattera volumes list|policy|snapshots|snapshot|restore``: volumes and their snapshots."""

from __future__ import annotations

import time
from typing import Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import Control, control, err, fail, run
from cli.edits import commit_edit
from cli.options import JSON, WIDE, set_output
from cli.render import Col
from shared.names import env_label
from shared.settings import settings

volumes_app = typer.Typer(no_args_is_help=True, help="Volumes and their snapshots.")


@volumes_app.command("list")
def volumes_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Volumes, their pinned node and their snapshots."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            items = c.view.volumes()
            if render.json_mode():
                render.messages(items)
                return
            snaps = c.view.snapshots()
            rows = []
            for v in items:
                mine = [s for s in snaps if s.volume_id == v.meta.id]
                rows.append(
                    [
                        v.meta.id,
                        v.name,
                        env_label(c.view, v.environment_id),
                        v.node_id,
                        render.enum_name(pb.VolumeStatus, v.status, "VOLUME_STATUS_"),
                        v.snapshot_policy.schedule or "-",
                        len(mine),
                    ]
                )
            render.table("volumes", ["id", "name", "env", "node", "status", "schedule", "snapshots"], rows)

    run(go)


@volumes_app.command("policy")
def volumes_policy(
    volume_id: str = typer.Argument(..., help="volume id (see `zattera volumes list`)"),
    schedule: str | None = typer.Option(
        None, "--schedule", help='cron, 5 fields in UTC (CRON_TZ=Zone prefix, @daily, @every 6h); "" = manual only'
    ),
    keep_last: int | None = typer.Option(None, "--keep-last", min=0, max=1000, help="COMPLETE snapshots kept; 0 = 7"),
    pre_hook: str | None = typer.Option(
        None, "--pre-hook", help='shell command run in the instance before each snapshot; "" = none'
    ),
    json: bool = JSON,
) -> None:
    """Set a volume's snapshot policy (only the options given change; `apps apply` uses the same code)."""
    from cli.apply import with_policy
    from cli.spec import PolicyChange, validate_schedule

    set_output(json)
    if schedule is not None:
        try:
            schedule = validate_schedule(schedule)
        except ValueError as exc:
            raise fail(f"--schedule: {exc}") from None
    change = PolicyChange(schedule=schedule, keep_last=keep_last, pre_hook=pre_hook)
    if not change:
        raise fail("give at least one of --schedule, --keep-last or --pre-hook")

    async def go() -> None:
        async with control() as c:

            def edit() -> pb.Volume | None:
                volume = c.view.volume(volume_id)
                if volume is None:
                    raise fail(f"volume {volume_id!r} not found")
                return with_policy(volume, change, time.time())

            await commit_edit(c, f"volume {volume_id}", edit)
            volume = c.view.volume(volume_id)
            assert volume is not None
            policy = volume.snapshot_policy
            if render.json_mode():
                render.emit_json(render.as_dict(policy))
                return
            err.print(
                f"volume {volume.name} ({volume_id}): schedule {policy.schedule or '(manual only)'}, "
                f"keep last {policy.keep_last or 7}, pre-hook {policy.pre_hook or '(none)'}",
                markup=False,
                highlight=False,
            )

    run(go)


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
            if render.json_mode():
                render.messages(records)
                return
            render.table(
                f"snapshots of volume {volume.name if volume else '(deleted)'} ({volume_id})",
                ["id", "state", "created", "size", "uploaded", Col("error", wrap=True)],
                [
                    [
                        s.meta.id,
                        render.enum_name(pb.SnapshotStatus, s.status, "SNAPSHOT_STATUS_"),
                        render.ts(s.meta.created_at),
                        f"{s.logical_size_bytes:,} B",
                        f"{s.uploaded_bytes:,} B",
                        s.error,
                    ]
                    for s in records
                ],
            )

    run(go)


def _snapshot_dispatcher(c: Control) -> Any:
    from shared.clock import RealClock
    from shared.snapshots.dispatch import operator_dispatcher

    return operator_dispatcher(c.conn, c.view, RealClock(), settings().restore_timeout)


@volumes_app.command("snapshot")
def volumes_snapshot(volume_id: str) -> None:
    """Snapshot a volume now (on its node), and wait for the result."""

    async def go() -> None:
        async with control() as c:
            volume = c.view.volume(volume_id)
            if volume is None:
                raise fail(f"volume {volume_id!r} not found")
            err.print(f"snapshotting volume {volume.name} on node {volume.node_id} …")
            try:
                record = await _snapshot_dispatcher(c).snapshot(volume, c.writer)
            except Exception as exc:
                raise fail(f"snapshot failed: {exc}") from None
            status = render.enum_name(pb.SnapshotStatus, record.status, "SNAPSHOT_STATUS_")
            err.print(
                f"snapshot {record.meta.id}: {status}, {record.logical_size_bytes:,} bytes, "
                f"{record.uploaded_bytes:,} uploaded {record.error}"
            )
            if record.status != pb.SNAPSHOT_STATUS_COMPLETE:
                raise typer.Exit(1)

    run(go)


@volumes_app.command("restore")
def volumes_restore(volume_id: str, snapshot_id: str) -> None:
    """Rebuild a volume from a COMPLETE snapshot (ids: `volumes snapshots VOL`); not while mounted or restoring."""

    async def go() -> None:
        async with control() as c:
            try:
                await _snapshot_dispatcher(c).restore(volume_id, snapshot_id, c.writer)
            except Exception as exc:
                raise fail(f"restore refused or failed: {exc}") from None
            err.print(f"volume {volume_id} restored from snapshot {snapshot_id}")

    run(go)
