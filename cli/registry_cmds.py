"""``zattera registry login|logout``: the credentials the docker runtime pulls an environment's ``docker://``
images with (docs/containers.md, "Registry credentials").

They are the environment's sealed secret ``ZATTERA_REGISTRY_AUTH`` (shared/registryauth.py), written like
any ``zattera secrets set``: sealed before they leave the CLI, the password read from stdin or a prompt
(never an argument: it would sit in the shell history and the process list), never printed.
"""

from __future__ import annotations

import getpass
import sys

import typer

from cli.config_cmds import ENV, NO_DEPLOY, WATCH, fail, roll_out
from cli.secrets_cmds import _unset_edit
from shared.appconfig import ConfigError, check_secret_value
from shared.registryauth import REGISTRY_AUTH_SECRET, registry_auth_value
from shared.secret_edits import set_secret_edit

registry_app = typer.Typer(
    no_args_is_help=True, help="Registry credentials for docker:// images (a sealed secret of the environment)."
)


def _read_password() -> str:
    if sys.stdin.isatty():
        return getpass.getpass("password: ")
    return sys.stdin.read().removesuffix("\n")  # `echo $TOKEN |` adds one newline


@registry_app.command("login")
def registry_login(
    server: str = typer.Argument(..., help="the registry host, e.g. ghcr.io or registry.example.com:5000"),
    env: str = ENV,
    username: str = typer.Option(..., "--username", "-u", help="the registry user"),
    no_deploy: bool = NO_DEPLOY,
    watch: bool = WATCH,
) -> None:
    """Set the environment's registry credentials; the password comes from stdin or a prompt."""
    try:
        value = registry_auth_value(server, username, _read_password())
        value = check_secret_value(REGISTRY_AUTH_SECRET, value.encode())
    except ConfigError as exc:
        raise fail(str(exc)) from None
    roll_out(
        env,
        f"registry credentials for {server} set",
        lambda view: set_secret_edit(view, REGISTRY_AUTH_SECRET, value),
        deploy=not no_deploy,
        watch=watch,
        span_name="cli.registry.login",
        server=server,
    )


@registry_app.command("logout")
def registry_logout(env: str = ENV, no_deploy: bool = NO_DEPLOY, watch: bool = WATCH) -> None:
    """Remove the environment's registry credentials (releases that used them keep them, for rollbacks)."""
    roll_out(
        env,
        "registry credentials removed",
        lambda view: _unset_edit(view, [REGISTRY_AUTH_SECRET]),
        deploy=not no_deploy,
        watch=watch,
        span_name="cli.registry.logout",
    )
