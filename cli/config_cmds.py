"""``zattera config set|unset|list``: an environment's plain variables (docs/secrets.md).

A change is ONE fenced write of the environment; when the env runs a release, the same write makes a new
release (same image, new configuration) and its deployment, which rolls out red/green like any deploy
(``--no-deploy`` stages it for the next deploy instead). Variables are not secret: use ``zattera secrets``
for values that are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import Control, control, err, run
from shared.appconfig import (
    ConfigError,
    check_env_size,
    check_name,
    parse_assignments,
    secret_sizes,
    with_vars,
)
from shared.deploy import ConfigEdit, Deployer, DeployError
from shared.state.reader import StateReader
from shared.telemetry import span
from shared.txn import Txn

config_app = typer.Typer(no_args_is_help=True, help="Plain environment variables of an environment.")

ENV = typer.Option(..., "--env", help="environment id or project/app/env")
NO_DEPLOY = typer.Option(False, "--no-deploy", help="stage the change for the next deploy instead of rolling it out")
WATCH = typer.Option(True, "--watch/--no-watch", help="follow the rollout until it is live")
JSON = typer.Option(False, "--json", help="machine-readable output")


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print("[red]error:[/] ", end="")
    err.print(message, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def say(message: str) -> None:
    err.print(message, markup=False, highlight=False, soft_wrap=True)


def target_env(view: StateReader, ref: str) -> pb.Environment:
    from cli.apply import resolve_env

    env = resolve_env(view, ref)
    if env is None:
        raise fail(f"--env: no environment {ref!r} (use an id or project/app/env)")
    return env


def running_release(view: StateReader, env: pb.Environment) -> pb.Release | None:
    return view.release(env.active_release_id) if env.active_release_id else None


async def reconfigure(c: Control, env: pb.Environment, what: str, edit: ConfigEdit, *, deploy: bool) -> str:
    """Commit ``edit`` (and its rollout); prints what happened; returns the deployment id or ""."""
    from cli.apply import env_path

    try:
        done = await Deployer(c.writer, created_by="cli").reconfigure(env.meta.id, edit, deploy=deploy)
    except (ConfigError, DeployError) as exc:
        raise fail(str(exc)) from None
    path = env_path(c.view, done.environment)
    version = done.environment.service.config_version
    if done.deployment is not None and done.release is not None:
        say(
            f"{what}: config v{version} of {path}; release v{done.release.version} rolling out"
            f" (deployment {done.deployment.meta.id})"
        )
        return done.deployment.meta.id
    staged = "staged for the next deploy" if env.active_release_id else "used by the first deploy"
    say(f"{what}: config v{version} of {path}, {staged}")
    return ""


def follow(deployment_id: str, watch: bool) -> None:
    if deployment_id and watch:
        from cli.watch import watch_deployment

        raise typer.Exit(run(lambda: watch_deployment(deployment_id, until_done=False)))


def roll_out(
    env: str,
    what: str,
    make_edit: Callable[[StateReader], ConfigEdit],
    *,
    deploy: bool,
    watch: bool,
    span_name: str,
    **attributes: Any,
) -> None:
    """Commit the edit ``make_edit`` builds on the current view to ``env``, then follow its rollout."""

    async def go() -> str:
        async with control() as c:
            return await reconfigure(c, target_env(c.view, env), what, make_edit(c.view), deploy=deploy)

    with span(span_name, env=env, **attributes):
        follow(run(go), watch)


def check_names(field: str, names: list[str]) -> None:
    """Every name a POSIX environment name, else the CLI fails naming ``<field>.<name>``."""
    for name in names:
        try:
            check_name(f"{field}.{name}", name)
        except ConfigError as exc:
            raise fail(str(exc)) from None


def _vars_edit(view: StateReader, change: Mapping[str, str | None]) -> ConfigEdit:
    """Set (value) or remove (None) variables; refuses a name that is also a secret, and an env over 1 MiB."""

    def edit(env: pb.Environment, _txn: Txn) -> None:
        merged = dict(env.service.vars)
        for name, value in change.items():
            if value is None:
                if merged.pop(name, None) is None:
                    raise ConfigError(f"vars.{name}", "not set on this environment")
            elif name in env.service.secrets:
                raise ConfigError(f"vars.{name}", "is a secret of this environment; `zattera secrets unset` it first")
            else:
                merged[name] = value
        check_env_size(merged, secret_sizes(env.service, view.secrets(env.meta.id)), field="vars")
        with_vars(env.service, merged)

    return edit


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
    roll_out(
        env,
        f"set {', '.join(values)}",
        lambda view: _vars_edit(view, values),
        deploy=not no_deploy,
        watch=watch,
        span_name="cli.config.set",
        names=",".join(values),
    )


@config_app.command("unset")
def config_unset(
    names: list[str] = typer.Argument(..., metavar="KEY", help="variables to remove"),
    env: str = ENV,
    no_deploy: bool = NO_DEPLOY,
    watch: bool = WATCH,
) -> None:
    """Remove environment variables."""
    check_names("vars", names)
    change: dict[str, str | None] = dict.fromkeys(names)
    roll_out(
        env,
        f"unset {', '.join(names)}",
        lambda view: _vars_edit(view, change),
        deploy=not no_deploy,
        watch=watch,
        span_name="cli.config.unset",
        names=",".join(names),
    )


@config_app.command("list")
def config_list(env: str = ENV, json: bool = JSON) -> None:
    """An environment's variables (staged), its config version and the running release's."""

    async def go() -> None:
        from cli.apply import env_path

        async with control() as c:
            target = target_env(c.view, env)
            running = running_release(c.view, target)
            running_vars = dict(running.service.vars) if running else {}
            rows = [
                {"name": k, "value": v, "running": running_vars.get(k) == v}
                for k, v in sorted(target.service.vars.items())
            ]
            if json:
                render.emit_json(
                    {
                        "environment_id": target.meta.id,
                        "config_version": target.service.config_version,
                        "running_config_version": running.service.config_version if running else None,
                        "vars": rows,
                    }
                )
                return
            running_version = f"v{running.service.config_version}" if running else "none"
            config_version = f"config v{target.service.config_version}, running {running_version}"
            render.table(
                f"vars of {env_path(c.view, target)} ({config_version})",
                ["name", "value", "running"],
                [[r["name"], r["value"], "yes" if r["running"] else "staged"] for r in rows],
            )

    run(go)
