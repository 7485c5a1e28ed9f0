"""``zattera secrets set|unset|list|rotate-key``: sealed secrets of an environment (docs/secrets.md).

Setting, unsetting and rotating are operator actions (:mod:`shared.actions.secrets`: the value is sealed to
the cluster key before anything is written). This module reads the value (``--from-file``, stdin or a
prompt, never an argument), calls them and prints what they did; ``list`` shows names, versions and
dates. The value is never printed, logged, traced or put in an error.
"""

from __future__ import annotations

import getpass
import sys
from dataclasses import asdict
from pathlib import Path

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import fail, on_cluster, say
from cli.config_cmds import (
    ENV,
    NO_DEPLOY,
    WATCH,
    Rows,
    check_names,
    list_config,
    roll_out,
)
from cli.options import JSON
from shared.actions.secrets import (
    RotateSecretsKey,
    SetSecret,
    UnsetSecrets,
    rotate_secrets_key,
    set_secret,
    unset_secrets,
)
from shared.appconfig import ConfigError, check_name, check_secret_value
from shared.telemetry import span

secrets_app = typer.Typer(no_args_is_help=True, help="Sealed secrets of an environment (values never shown).")


def _read_value(name: str, from_file: Path | None) -> bytes:
    if from_file is not None:
        try:
            return from_file.read_bytes()
        except OSError as exc:
            raise fail(f"--from-file {str(from_file)!r}: cannot read it: {exc.strerror or exc}") from None
    if sys.stdin.isatty():
        first = getpass.getpass(f"value of {name}: ")
        if getpass.getpass(f"value of {name} (again): ") != first:
            raise fail(f"secrets.{name}: the two values differ; nothing was changed")
        return first.encode()
    data = sys.stdin.buffer.read()
    return data[:-1] if data.endswith(b"\n") else data  # `echo value |` adds one newline


def name_without_value(name: str) -> str:
    """``NAME=value`` typed as a name is refused without showing the value: an error message would print
    it, a terminal keep it on screen and a CI log forever; the shell's history already holds it."""
    if "=" not in name:
        return name
    given = name.partition("=")[0]
    raise fail(
        f"secrets.{given}: give the name only; the value comes from --from-file, stdin or a prompt, never the "
        "command line (the value typed was not used or shown; your shell's history still holds it)"
    )


@secrets_app.command("set")
def secrets_set(
    name: str = typer.Argument(..., help="the secret's name (a POSIX environment variable name)"),
    env: str = ENV,
    from_file: Path = typer.Option(None, "--from-file", help="read the value from this file (else stdin or a prompt)"),
    no_deploy: bool = NO_DEPLOY,
    watch: bool = WATCH,
) -> None:
    """Set a secret: the value comes from --from-file, stdin, or a prompt; it is sealed before it leaves."""
    name = name_without_value(name)
    try:
        check_name(f"secrets.{name}", name)
        value = check_secret_value(name, _read_value(name, from_file))
    except ConfigError as exc:
        raise fail(str(exc)) from None
    request = SetSecret(env, name, value, deploy=not no_deploy)
    roll_out("cli.secrets.set", f"secret {name} set", set_secret, request, watch=watch, secret=name)


@secrets_app.command("unset")
def secrets_unset(
    names: list[str] = typer.Argument(..., metavar="NAME", help="secrets to remove"),
    env: str = ENV,
    no_deploy: bool = NO_DEPLOY,
    watch: bool = WATCH,
) -> None:
    """Remove secrets (their old versions stay while a release still uses them, for rollbacks)."""
    names = [name_without_value(name) for name in names]
    check_names("secrets", names)
    request = UnsetSecrets(env, names, deploy=not no_deploy)
    what = f"secret {', '.join(names)} unset"
    roll_out("cli.secrets.unset", what, unset_secrets, request, watch=watch, names=",".join(names))


@secrets_app.command("list")
def secrets_list(env: str = ENV, json: bool = JSON) -> None:
    """Names, versions and update times of an environment's secrets (never values)."""

    def rows(target: pb.Environment, running: pb.Release | None) -> Rows:
        running_refs = running.service.secrets if running else {}
        return [
            {
                "name": name,
                "version": ref.version,
                "updated_at": render.ts(ref.updated_at),
                "running_version": running_refs[name].version if name in running_refs else None,
            }
            for name, ref in sorted(target.service.secrets.items())
        ]

    def table(path: str, target: pb.Environment, _running: pb.Release | None, found: Rows) -> None:
        render.table(
            f"secrets of {path} (config v{target.service.config_version})",
            ["name", "version", "updated", "running"],
            [
                [
                    r["name"],
                    f"v{r['version']}",
                    r["updated_at"],
                    f"v{r['running_version']}" if r["running_version"] else "-",
                ]
                for r in found
            ],
        )

    list_config(env, json, "secrets", rows, table)


@secrets_app.command("rotate-key")
def secrets_rotate_key(json: bool = JSON) -> None:
    """Make a new cluster secrets key and re-seal every secret under it; apps keep running."""
    with span("cli.secrets.rotate_key"):
        done = on_cluster(rotate_secrets_key, RotateSecretsKey(), view=False)
    if json:
        render.emit_json(asdict(done))
        return
    say(f"cluster key {done.previous_key_id} -> {done.key_id}: {done.resealed} secret version(s) re-sealed")
