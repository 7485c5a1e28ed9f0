"""``zattera backup create|list|verify|schedule|unschedule|status`` and ``zattera restore``: the whole
cluster to a directory or an S3-compatible store and back (docs/backup.md). The work is in
:mod:`shared.actions.backup`, :mod:`shared.actions.backup_restore` and :mod:`shared.actions.backup_schedule`.

The recovery passphrase comes from ``ZATTERA_RECOVERY_PASSPHRASE``, a prompt, or the first line of stdin —
never an argument; S3 credentials from boto3's usual sources (``AWS_ACCESS_KEY_ID``…), never an argument
(``backup schedule`` seals the ones set in its environment into the schedule, for the cluster to use later).
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import sys
from pathlib import Path

import typer

from cli import render
from cli.client import fail, on_cluster, read_on_cluster, run
from cli.layout import DataLayout
from cli.options import JSON, set_output
from shared.actions.backup import CreateBackup, ListBackups, VerifyBackup, create_backup, list_backups, verify_backup
from shared.actions.backup_restore import RestoreBackup, restore_backup
from shared.actions.backup_schedule import (
    DEFAULT_KEEP,
    ScheduleBackups,
    UnscheduleBackups,
    schedule_backups,
    unschedule_backups,
)
from shared.backup.status import backup_status, describe
from shared.backup.targets import credentials_from_environment
from shared.settings import settings

PASSPHRASE_ENV = "ZATTERA_RECOVERY_PASSPHRASE"

backup_app = typer.Typer(no_args_is_help=True, help="Backups of the whole cluster (docs/backup.md).")

DATA_DIR = typer.Option(
    None, "--data-dir", help="the control plane's data directory (default: $ZATTERA_DATA_DIR or .zattera)"
)
BACKUP_ID = typer.Option("", "--backup", help="a backup id (default: the newest)")
SOURCE = typer.Option(..., "--from", help="a directory, or s3://bucket[/prefix]")


def _control_dir(data_dir: Path | None) -> Path:
    return DataLayout((data_dir or settings().data_dir).resolve()).control


def _keyring_path(data_dir: Path | None) -> str:
    return str(_control_dir(data_dir) / "secrets" / "cluster.key")


def _local_ca_dir(data_dir: Path | None) -> str:
    from shared import localca  # cryptography: only for the commands that carry the CA

    return str(localca.directory(_control_dir(data_dir)))


def _passphrase(*, twice: bool) -> str:
    given = os.environ.get(PASSPHRASE_ENV)
    if given:
        return given
    if not sys.stdin.isatty():
        return sys.stdin.readline().removesuffix("\n")
    first = getpass.getpass("recovery passphrase: ")
    if twice and getpass.getpass("recovery passphrase (again): ") != first:
        raise fail("recovery passphrase: the two entries differ; nothing was done")
    return first


@backup_app.command("create")
def create(
    to: str = typer.Option(..., "--to", help="a directory, or s3://bucket[/prefix]"),
    data_dir: Path = DATA_DIR,
    json: bool = JSON,
) -> None:
    """Back the cluster up: state, certificates, console users, sources and images, and the cluster secrets
    key and the local CA sealed to the recovery passphrase (keep it: without it a backup restores nothing secret)."""
    set_output(json)
    request = CreateBackup(to, _passphrase(twice=True), _keyring_path(data_dir), local_ca_dir=_local_ca_dir(data_dir))

    created = on_cluster(create_backup, request, view=False)
    render.report(
        created,
        f"backup {created.id} at {created.target}: {created.objects} objects, {created.bytes} bytes, "
        f"{created.sent_bytes} sent, state revision {created.revision}",
    )


@backup_app.command("list")
def list_cmd(source: str = SOURCE, json: bool = JSON) -> None:
    """The backups on a target, oldest first (no cluster needed)."""
    set_output(json)
    render.listing(
        "backups",
        ["id", "taken", "version", "schema", "objects", "bytes", "manifest"],
        run(lambda: list_backups(ListBackups(source))),
        lambda b: [b.id, render.when(b.created_at), b.version, b.schema, b.objects, b.bytes, b.problem or "ok"],
    )


@backup_app.command("verify")
def verify(
    source: str = SOURCE,
    backup_id: str = BACKUP_ID,
    json: bool = JSON,
) -> None:
    """Read every object of a backup and check it against the manifest's SHA-256 (no cluster needed)."""
    set_output(json)
    verified = run(lambda: verify_backup(VerifyBackup(source, backup_id)))
    render.report(verified, f"backup {verified.id}: {verified.objects} objects, {verified.bytes} bytes, all intact")


def restore(
    source: str = SOURCE,
    backup_id: str = BACKUP_ID,
    force: bool = typer.Option(False, "--force", help="restore into a cluster that is not empty"),
    data_dir: Path = DATA_DIR,
    json: bool = JSON,
) -> None:
    """Restore a backup into this (fresh) cluster: every object is checked and the secrets key opened with
    the recovery passphrase before anything is written; the old machines' nodes and leases are left out, so
    replicas are placed on this cluster's nodes."""
    set_output(json)
    request = RestoreBackup(
        source, _passphrase(twice=False), _keyring_path(data_dir), backup_id, force, _local_ca_dir(data_dir)
    )

    restored = on_cluster(restore_backup, request, follow=True)
    lines = [
        f"backup {restored.id} restored: {restored.keys} state keys, {restored.objects} objects, "
        f"{restored.console_users} console users, {len(restored.volumes)} volumes' data",
        *(f"local CA restored (SHA-256 {ca}): the certs service issues from it" for ca in [restored.local_ca] if ca),
        *(f"left out: {note}" for note in restored.skipped),
    ]
    render.report(restored, *lines)


@backup_app.command("schedule")
def schedule(
    cron: str = typer.Argument(..., metavar="SCHEDULE", help='cron in UTC, e.g. "0 3 * * *", "@daily", "@every 6h"'),
    to: str = typer.Option(..., "--to", help="a directory on the control machine, or s3://bucket[/prefix]"),
    keep: int = typer.Option(DEFAULT_KEEP, "--keep", help="verified backups kept on the target"),
    json: bool = JSON,
) -> None:
    """Back the cluster up on a schedule, run by the control plane. The recovery passphrase is asked here and
    only a public key derived from it is stored; S3 settings set in this environment (AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION) are stored sealed. A failed run is
    shown by `zattera status` until a later one succeeds."""
    set_output(json)
    credentials = credentials_from_environment() if to.startswith("s3://") else {}
    request = ScheduleBackups(cron, to, _passphrase(twice=True), keep, credentials)
    done = on_cluster(schedule_backups, request)
    stored = f"; S3 settings stored sealed: {', '.join(done.credentials)}" if done.credentials else ""
    render.report(done, f"backups scheduled: {done.schedule} to {done.target}, keeping {done.keep} verified{stored}")


@backup_app.command("unschedule")
def unschedule(json: bool = JSON) -> None:
    """Stop the scheduled backups (the backups already taken stay on their target)."""
    set_output(json)
    on_cluster(unschedule_backups, UnscheduleBackups())
    render.report({"scheduled": False}, "scheduled backups stopped")


@backup_app.command("status")
def status(json: bool = JSON) -> None:
    """The backup schedule and what its last run did."""
    set_output(json)
    found = read_on_cluster(lambda ctx: backup_status(ctx.view))
    if render.json_mode():
        render.emit_json({**dataclasses.asdict(found), "failing": found.failing})
        return
    for line in describe(found):
        print(line)
    if found.failing:
        raise typer.Exit(1)
