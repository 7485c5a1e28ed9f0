"""``zattera registry login|logout``: the credentials the docker runtime pulls an environment's ``docker://``
images with (docs/containers.md, "Registry credentials").

They are the environment's sealed secret ``ZATTERA_REGISTRY_AUTH`` (shared/registryauth.py), written like
any ``zattera secrets set`` (:func:`shared.actions.secrets.registry_login`): sealed before they are
written, the password read from stdin or a prompt (never an argument: it would sit in the shell history
and the process list), never printed.
"""

from __future__ import annotations

import getpass
import sys

import typer

from cli.config_cmds import ENV, NO_DEPLOY, WATCH, roll_out
from shared.actions.secrets import RegistryLogin, RegistryLogout
from shared.actions.secrets import registry_login as registry_login_action
from shared.actions.secrets import registry_logout as registry_logout_action

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
    request = RegistryLogin(env, server, username, _read_password(), deploy=not no_deploy)
    what = f"registry credentials for {server} set"
    roll_out("cli.registry.login", what, registry_login_action, request, watch=watch, server=server)


@registry_app.command("logout")
def registry_logout(env: str = ENV, no_deploy: bool = NO_DEPLOY, watch: bool = WATCH) -> None:
    """Remove the environment's registry credentials (releases that used them keep them, for rollbacks)."""
    request = RegistryLogout(env, deploy=not no_deploy)
    roll_out("cli.registry.logout", "registry credentials removed", registry_logout_action, request, watch=watch)
