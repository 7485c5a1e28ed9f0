"""``zattera addons``: managed databases (docs/addons.md). Every change is an operator action of
:mod:`shared.actions.addons`; no command prints a password (they are sealed secrets of the database's env)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TypeVar

import typer

from cli import render
from cli.client import FIELD_LABELS, control, fail, on_cluster, run, say
from cli.config_cmds import NO_DEPLOY
from cli.options import JSON, set_output
from shared.actions.addon_attach import AttachAddon, attach_addon, detach_addon
from shared.actions.addon_restore import addon_backups, restore_addon, set_addon_offsite
from shared.actions.addons import (
    AddonCreated,
    AddonInfo,
    AddonOffsite,
    CreateAddon,
    DeleteAddon,
    RestoreAddon,
    addon_info,
    create_addon,
    delete_addon,
    list_addons,
)
from shared.actions.refusals import ActionRefused
from shared.addons import spec as addon
from shared.addons.backups import BackupStatus
from shared.backup.targets import credentials_from_environment
from shared.clock import parse_instant

addons_app = typer.Typer(no_args_is_help=True, help="Managed databases: PostgreSQL and Redis (docs/addons.md).")

T = TypeVar("T")
LABELS = {
    **FIELD_LABELS,
    "engine": "ENGINE",
    "name": "NAME",
    "project": "--project",
    "version": "--version",
    "as_name": "--as",
    "to_time": "--to-time",
    "archive_timeout": "--archive-timeout",
    "backup_interval": "--backup-interval",
    "source": "--from",
    "schedule": "--schedule",
    "offsite": "TARGET",
}
NAME = typer.Argument(..., help="the database's name (its app in the project)")
PROJECT = typer.Option(..., "--project", "-p", help="the project the database belongs to")


def _act(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a read (or a session) on the cluster; a refusal is one line naming the option as this command spells
    it. An action goes through :func:`cli.client.on_cluster` with the same ``labels``."""

    async def go() -> T:
        try:
            return await fn()
        except ActionRefused as exc:
            raise fail(exc.said_as(LABELS)) from None

    return run(go)


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if epoch else "-"


def parse_time(value: str) -> float:
    """``--to-time``: ISO 8601 (no zone = UTC) or epoch seconds (:func:`shared.clock.parse_instant`)."""
    try:
        return parse_instant(value)
    except ValueError as exc:
        raise fail(f"--to-time: {exc}") from None


def _created(done: AddonCreated, json: bool, what: str) -> None:
    if json:
        render.emit_json({**asdict(done.info), "deployment_id": done.deployment_id})
        return
    info = done.info
    say(
        f"{what} {info.project}/{info.name} ({info.engine} {info.version}): starting as env {info.env}, private"
        f" address {info.address}; attach it with `zattera addons attach {info.name} --env {info.project}/APP/ENV`"
    )


@addons_app.command("create")
def addons_create(
    engine: str = typer.Argument(..., help="postgres or redis"),
    name: str = NAME,
    project: str = PROJECT,
    version: str = typer.Option("", "--version", help="the server version (default: the newest installed)"),
    archive_timeout: int = typer.Option(
        addon.ARCHIVE_TIMEOUT, "--archive-timeout", help="PostgreSQL: seconds of writes at most not yet archived"
    ),
    backup_interval: int = typer.Option(
        addon.BACKUP_INTERVAL, "--backup-interval", help="PostgreSQL: seconds between full base backups"
    ),
    json: bool = JSON,
) -> None:
    """Create a database: a stateful env running the real server, passwords generated and sealed."""

    request = CreateAddon(engine, name, project, version, archive_timeout, backup_interval)
    _created(on_cluster(create_addon, request, labels=LABELS), json, "database")


@addons_app.command("attach")
def addons_attach(
    name: str = NAME,
    env: str = typer.Option(..., "--env", help="the env that gets DATABASE_URL (project/app/env or id)"),
    no_deploy: bool = NO_DEPLOY,
) -> None:
    """Give an env the database's URL (DATABASE_URL and PG*, or REDIS_URL) as sealed secrets; it rolls out."""

    done = on_cluster(attach_addon, AttachAddon(name, env, deploy=not no_deploy), labels=LABELS)
    rolled = f"; rolling out release v{done.release_version}" if done.deployment_id else " (staged for the next deploy)"
    say(f"database {name} attached to {done.env}{rolled}")


@addons_app.command("detach")
def addons_detach(
    name: str = NAME, env: str = typer.Option(..., "--env", help="the env"), no_deploy: bool = NO_DEPLOY
) -> None:
    """Remove the database's URL and PG* variables from an env; it rolls out."""

    done = on_cluster(detach_addon, AttachAddon(name, env, deploy=not no_deploy), labels=LABELS)
    say(f"database {name} detached from {done.env}")


@addons_app.command("restore")
def addons_restore(
    name: str = NAME,
    project: str = PROJECT,
    as_name: str = typer.Option(..., "--as", help="the NEW database's name (the original is never touched)"),
    to_time: str = typer.Option("", "--to-time", help="the point in time (ISO 8601 or epoch seconds; UTC)"),
    latest: bool = typer.Option(False, "--latest", help="everything the archive holds"),
    source: str = typer.Option(
        "",
        "--from",
        help="an off-site target (s3://bucket[/prefix] or a directory; AWS_* from the environment): restore from"
        " the newest copy of the backups there (`addons offsite`), not from the node's volume",
    ),
    json: bool = JSON,
) -> None:
    """Point-in-time recovery as a fork: a new database from the nearest base backup plus WAL up to the time."""
    if bool(to_time) == latest:
        raise fail("--to-time: give --to-time T or --latest (one of them)")
    target = parse_time(to_time) if to_time else None
    settings = credentials_from_environment() if source.startswith("s3://") else {}

    request = RestoreAddon(name, project, as_name, target, source=source, settings=settings)
    _created(on_cluster(restore_addon, request, labels=LABELS), json, "restoring")


@addons_app.command("offsite")
def addons_offsite(
    name: str = NAME,
    target: str = typer.Argument(..., help='s3://bucket[/prefix] or a directory; "" stops the copies'),
    project: str = PROJECT,
    schedule: str = typer.Option("@every 1h", "--schedule", help="how often the backups are copied"),
    json: bool = JSON,
) -> None:
    """Copy a PostgreSQL database's backups off-site (its backups volume's snapshots; AWS_* settings from the
    environment, stored sealed): `addons restore --from TARGET` restores from there when the node is gone."""
    settings = credentials_from_environment() if target.startswith("s3://") else {}

    done = on_cluster(set_addon_offsite, AddonOffsite(name, project, target, schedule, settings), labels=LABELS)
    if json:
        render.emit_json(asdict(done))
        return
    stored = f" (settings stored sealed: {', '.join(done.offsite_settings)})" if done.offsite_settings else ""
    if done.offsite:
        say(f"backups of {project}/{name} (volume {done.volume_id}) copied to {done.offsite} {done.schedule}{stored}")
    else:
        say(f"backups of {project}/{name} no longer copied off-site")


@addons_app.command("list")
def addons_list(
    project: str = typer.Option("", "--project", "-p", help="only this project's"), json: bool = JSON
) -> None:
    """The databases: engine, version, state, private address, attached envs."""
    set_output(json)

    async def go() -> list[AddonInfo]:
        async with control() as c:
            return list_addons(c.view, project)

    render.listing(
        "databases",
        ["project", "name", "engine", "state", "address", "attached to"],
        _act(go),
        lambda r: [
            r.project,
            r.name,
            f"{r.engine} {r.version}",
            r.status or "-",
            r.address,
            ", ".join(r.attached_to) or "-",
        ],
    )


@addons_app.command("info")
def addons_info(name: str = NAME, project: str = PROJECT, json: bool = JSON) -> None:
    """One database: its env, state, node, volumes, attachments, where it was restored from."""

    async def go() -> AddonInfo:
        async with control() as c:
            return addon_info(c.view, name, project)

    info = _act(go)
    if json:
        render.emit_json(asdict(info))
        return
    for label, value in (
        ("database", f"{info.project}/{info.name}"),
        ("engine", f"{info.engine} {info.version}"),
        ("env", info.env),
        ("state", info.status or "-"),
        ("node", info.node_id or "-"),
        ("address", info.address),
        ("release", f"v{info.release_version}" if info.release_version else "-"),
        ("created", _utc(info.created_at)),
        ("volumes", ", ".join(f"{k} {v}" for k, v in sorted(info.volumes.items())) or "- (created at the first start)"),
        ("attached to", ", ".join(info.attached_to) or "-"),
        ("restored from", f"{info.restored_from} at {info.restore_target}" if info.restored_from else "-"),
        ("off-site", info.offsite or "-"),
    ):
        typer.echo(f"{label:14} {value}")


@addons_app.command("backups")
def addons_backups(name: str = NAME, project: str = PROJECT, json: bool = JSON) -> None:
    """A PostgreSQL database's base backups and its recoverable window (what --to-time may be)."""

    async def go() -> BackupStatus:
        async with control() as c:
            return await addon_backups(c.actions, name, project)

    status = _act(go)
    if json:
        render.emit_json(asdict(status))
        return
    render.table(
        f"base backups of {name}",
        ["label", "type", "started", "finished", "size", "stored"],
        [[b.label, b.type, _utc(b.started), _utc(b.stopped), f"{b.size:,}", f"{b.stored:,}"] for b in status.backups],
    )
    say(
        f"recoverable window: {_utc(status.window_start)} to {_utc(status.window_end)} (last archived WAL"
        f" {status.last_archived_wal or '-'}, {status.archive_failures} failed archive attempt(s);"
        f" reported {_utc(status.reported_at)})"
    )


@addons_app.command("logs")
def addons_logs(
    name: str = NAME,
    project: str = PROJECT,
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
    lines: int = typer.Option(100, "--lines", "-n", help="how many past lines to show first"),
    json: bool = JSON,
) -> None:
    """The database server's log (as `zattera logs --env PROJECT/NAME/db`)."""
    from cli.logs_cmds import logs

    logs(env=f"{project}/{name}/{addon.ENV_NAME}", follow=follow, lines=lines, since="", instance="", json_output=json)


@addons_app.command("delete")
def addons_delete(
    name: str = NAME,
    project: str = PROJECT,
    purge: bool = typer.Option(False, "--purge", help="also delete its volumes: its data AND its backups"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
) -> None:
    """Delete a database; its volumes (data and backups) are kept unless --purge."""
    if purge and not yes:
        typer.confirm(f"delete {project}/{name} with its data and every backup of it?", abort=True)

    done = on_cluster(delete_addon, DeleteAddon(name, project, purge), labels=LABELS)
    kept = "" if purge else f"; {done.get('volumes_kept', 0)} volume(s) kept (data and backups)"
    say(f"database {project}/{name} deleted{kept}")


@addons_app.command("psql")
def addons_psql(
    name: str = NAME,
    project: str = PROJECT,
    database: str = typer.Option(addon.APP_DB, "--database", "-d", help="the database to open"),
    command: str = typer.Option("", "--command", "-c", help="run this one command and exit (psql -c)"),
) -> None:
    """An interactive psql as the superuser, from this machine: the session is carried over NATS to the
    database's node, whose agent connects to the server's own socket (no password crosses anything)."""
    from shared.addons.tunnel import TunnelError, psql_binary, run_psql

    async def go() -> int:
        async with control() as c:
            info = addon_info(c.view, name, project)
            if info.engine != addon.POSTGRES:
                raise fail(f"NAME: {name} is a {info.engine} database; psql opens PostgreSQL ones")
            data_id = info.volumes.get(addon.DATA_VOLUME, "")
            if not data_id or not info.node_id:
                raise fail(f"NAME: {name} is not running yet (no data volume placed on a node)")
            args = ["-d", database, *(["-c", command] if command else [])]
            try:
                psql = psql_binary(info.version)
                return await run_psql(
                    c.conn, info.node_id, data_id, args, psql=psql, on_error=lambda why: say(f"session ended: {why}")
                )
            except TunnelError as exc:
                raise fail(f"NAME: {name} (node {info.node_id}): {exc}") from None

    code = _act(go)
    raise typer.Exit(code)
