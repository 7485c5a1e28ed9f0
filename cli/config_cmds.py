"""``zattera config set|unset|list``: an environment's plain variables (docs/secrets.md), and what every
configuration command shares (options, the rollout it follows).

A change is the operator action :func:`shared.actions.config.change_vars`: ONE fenced write of the
environment, with a new release and its red/green deployment when the env runs one (``--no-deploy``
stages it for the next deploy instead). Variables are not secret: use ``zattera secrets`` for values that
are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, fail, run, say
from cli.options import JSON
from shared.actions.config import ChangeVars, ConfigChanged, change_vars
from shared.actions.context import ActionContext
from shared.actions.names import env_path, target_env
from shared.appconfig import ConfigError, check_name, parse_assignments
from shared.telemetry import span

config_app = typer.Typer(no_args_is_help=True, help="Plain environment variables of an environment.")

ENV = typer.Option(..., "--env", help="environment id or project/app/env")
NO_DEPLOY = typer.Option(False, "--no-deploy", help="stage the change for the next deploy instead of rolling it out")
WATCH = typer.Option(True, "--watch/--no-watch", help="follow the rollout until it is live")


Rows = list[dict[str, Any]]


def list_config(
    env: str,
    as_json: bool,
    key: str,
    rows: Callable[[pb.Environment, pb.Release | None], Rows],
    table: Callable[[str, pb.Environment, pb.Release | None, Rows], None],
) -> None:
    """``config list`` and ``secrets list``: the ``rows`` of the environment ``env`` (staged, beside the
    running release's); with ``--json`` as ``key``, beside the env's config version and the running release's,
    else printed by ``table`` (given the env's ``project/app/env``)."""

    async def go() -> None:
        async with control() as c:
            target = target_env(c.view, env)
            running = c.view.release(target.active_release_id) if target.active_release_id else None
            found = rows(target, running)
            if as_json:
                render.emit_json(
                    {
                        "environment_id": target.meta.id,
                        "config_version": target.service.config_version,
                        "running_config_version": running.service.config_version if running else None,
                        key: found,
                    }
                )
                return
            table(env_path(c.view, target), target, running, found)

    run(go)


def changed_text(what: str, done: ConfigChanged) -> str:
    """What a configuration change did: rolling out (which release, which deployment) or staged."""
    if done.deployment_id:
        return (
            f"{what}: config v{done.config_version} of {done.env}; release v{done.release_version} rolling out"
            f" (deployment {done.deployment_id})"
        )
    staged = "staged for the next deploy" if done.deployed else "used by the first deploy"
    return f"{what}: config v{done.config_version} of {done.env}, {staged}"


class EnvRequest(Protocol):
    """A configuration action's request: it names the environment it changes."""

    @property
    def env(self) -> str: ...


R = TypeVar("R", bound=EnvRequest)


def roll_out(
    span_name: str,
    what: str,
    change: Callable[[ActionContext, R], Awaitable[ConfigChanged]],
    request: R,
    *,
    watch: bool,
    **attributes: Any,
) -> None:
    """Run the configuration action ``change`` on ``request`` (traced as ``span_name``, with the request's
    environment), say what it did, then follow its rollout."""

    async def go() -> str:
        async with control() as c:
            done = await change(c.actions, request)
        say(changed_text(what, done))
        return done.deployment_id

    with span(span_name, env=request.env, **attributes):
        deployment_id = run(go)
    if deployment_id and watch:
        from cli.watch import watch_deployment

        raise typer.Exit(run(lambda: watch_deployment(deployment_id, until_done=False)))


def check_names(field: str, names: list[str]) -> None:
    """Every name a POSIX environment name, else the CLI fails naming ``<field>.<name>`` (before anything
    is read or asked)."""
    for name in names:
        try:
            check_name(f"{field}.{name}", name)
        except ConfigError as exc:
            raise fail(str(exc)) from None


@config_app.command("set")
def config_set(
    assignments: list[str] = typer.Argument(..., metavar="KEY=VALUE", help="variables to set"),
    env: str = ENV,
    no_deploy: bool = NO_DEPLOY,
    watch: bool = WATCH,
) -> None:
    """Set environment variables (one new config version for all of them)."""
    try:
        values = parse_assignments(assignments)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    request = ChangeVars(env, dict(values), deploy=not no_deploy)
    roll_out("cli.config.set", f"set {', '.join(values)}", change_vars, request, watch=watch, names=",".join(values))


@config_app.command("unset")
def config_unset(
    names: list[str] = typer.Argument(..., metavar="KEY", help="variables to remove"),
    env: str = ENV,
    no_deploy: bool = NO_DEPLOY,
    watch: bool = WATCH,
) -> None:
    """Remove environment variables."""
    check_names("vars", names)
    request = ChangeVars(env, dict.fromkeys(names), deploy=not no_deploy)
    roll_out("cli.config.unset", f"unset {', '.join(names)}", change_vars, request, watch=watch, names=",".join(names))


@config_app.command("list")
def config_list(env: str = ENV, json: bool = JSON) -> None:
    """An environment's variables (staged), its config version and the running release's."""

    def rows(target: pb.Environment, running: pb.Release | None) -> Rows:
        running_vars = dict(running.service.vars) if running else {}
        return [
            {"name": k, "value": v, "running": running_vars.get(k) == v} for k, v in sorted(target.service.vars.items())
        ]

    def table(path: str, target: pb.Environment, running: pb.Release | None, found: Rows) -> None:
        running_version = f"v{running.service.config_version}" if running else "none"
        render.table(
            f"vars of {path} (config v{target.service.config_version}, running {running_version})",
            ["name", "value", "running"],
            [[r["name"], r["value"], "yes" if r["running"] else "staged"] for r in found],
        )

    list_config(env, json, "vars", rows, table)
