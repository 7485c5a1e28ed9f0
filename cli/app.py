"""The ``zattera`` command line as a typer app: the operator interface (:func:`cli.main.main` runs it).

Every read command accepts ``--json``; every write goes through the fenced-write layer. This module assembles
the app from the command groups (``cli/*_cmds.py``, one module per group), each imported only when one of
its commands runs (:class:`LazyCommands`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import typer
import typer.core
from typer.core import TyperGroup

from cli.startup import apply_root_options, import_nats, paused_gc


def _coerce_plain_options_without_pydantic() -> None:
    """Typer coerces every parameter through a pydantic ``TypeAdapter`` it builds when the parameter is first
    processed: importing pydantic and building the adapters is about a fifth of a plain read
    (PERFORMANCE.md "CLI start-up"), for options that are a ``str`` or a ``bool`` flag. Those two are
    coerced here by typer's own rules (a ``str`` value or a ``bool`` is kept as it is); any other value
    (bytes, a ``bool`` option given as text, a custom parser) and every other annotation go to typer's
    adapter as before. Left alone when typer's internals are not the ones this was written for."""
    from typer import _coercion

    found: Any = getattr(_coercion, "build_runtime_param", None)
    runtime_param: Any = getattr(_coercion, "RuntimeParam", None)
    if found is None or runtime_param is None or getattr(typer.core, "build_runtime_param", None) is not found:
        return
    build = cast("Callable[[Any], Any]", found)

    @dataclass(frozen=True)
    class PlainRuntimeParam(runtime_param):  # type: ignore[misc]
        descriptor: Any

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            if type(value) is self.annotation:  # a str given as text, a bool flag
                return value
            return build(self.descriptor)._coerce_value(value, param, ctx)

    def build_runtime_param(descriptor: Any) -> Any:
        plain = descriptor.annotation in (str, bool) and descriptor.file_annotation is None
        if plain and descriptor.parameter_info.parser is None:
            return PlainRuntimeParam(descriptor.parameter_info, descriptor.annotation, descriptor)
        return build(descriptor)

    typer.core.build_runtime_param = build_runtime_param  # type: ignore[attr-defined]


_coerce_plain_options_without_pydantic()

COMMANDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deploy": ("cli.deploy_cmds", "deploy_app", {}),
    "nodes": ("cli.nodes_cmds", "nodes_app", {}),
    "apps": ("cli.apps_cmds", "apps_app", {}),
    "builds": ("cli.builds_cmds", "builds_app", {}),
    "build": ("cli.build_cmds", "build_app", {}),
    "volumes": ("cli.volumes_cmds", "volumes_app", {}),
    "security": ("cli.security_cmds", "security_app", {}),
    "config": ("cli.config_cmds", "config_app", {}),
    "secrets": ("cli.secrets_cmds", "secrets_app", {}),
    "domains": ("cli.domains_cmds", "domains_app", {}),
    "logs": ("cli.logs_cmds", "logs", {}),
    "events": ("cli.events_cmds", "events", {}),
    "cluster": ("cli.cluster_cmds", "cluster_app", {}),
    "context": ("cli.context_cmds", "context_app", {}),
    "jobs": ("cli.jobs_cmds", "jobs_app", {}),
    "network": ("cli.network_cmds", "network", {}),
    "run": ("cli.jobs_cmds", "run_command", {"context_settings": {"allow_interspersed_args": False}}),
    "images": ("cli.images_cmds", "images_app", {}),
    "console": ("cli.console_cmds", "console_app", {}),
    "registry": ("cli.registry_cmds", "registry_app", {}),
    "up": ("cli.up_cmds", "up", {}),
    "backup": ("cli.backup_cmds", "backup_app", {}),
    "restore": ("cli.backup_cmds", "restore", {}),
    "notify": ("cli.notify_cmds", "notify_app", {}),
    "rollback": ("cli.deploy_cmds", "rollback", {}),
    "releases": ("cli.deploy_cmds", "releases", {}),
    "ps": ("cli.inspect_cmds", "ps", {}),
    "routes": ("cli.inspect_cmds", "routes", {}),
    "status": ("cli.env_cmds", "status", {}),
    "scale": ("cli.env_cmds", "scale", {}),
    "envs": ("cli.env_cmds", "envs_app", {}),
    "projects": ("cli.env_cmds", "projects_app", {}),
    "drains": ("cli.drains_cmds", "drains_app", {}),
    "audit": ("cli.audit_cmds", "audit", {}),
    "git": ("cli.git_cmds", "git_app", {}),
    "users": ("cli.teams_cmds", "users_app", {}),
    "grants": ("cli.teams_cmds", "grants_app", {}),
    "tokens": ("cli.teams_cmds", "tokens_app", {}),
    "metrics": ("cli.metrics_cmds", "metrics", {}),
    "addons": ("cli.addons_cmds", "addons_app", {}),
}
"""Every command: name → (module, the Typer group or function there, its registration settings). The order
is the order of ``zattera --help``."""


class LazyCommands(TyperGroup):
    """The root group: a command's module is imported when that command runs (or a help lists it), so a plain
    read (`zattera status`) loads what it needs and not every command group's dependencies."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, name: str) -> Any:
        if name not in self.commands and name in COMMANDS:
            module, attribute, settings = COMMANDS[name]
            with paused_gc():
                import_nats()
                found = getattr(importlib.import_module(module), attribute)
            command: Any
            if isinstance(found, typer.Typer):
                command = typer.main.get_group(found)
            else:
                single = typer.Typer()
                single.command(name, **settings)(found)
                command = typer.main.get_command(single)
            command.name = name
            _one_line_summaries(command)
            self.commands[name] = command
        return self.commands.get(name)


def _one_line_summaries(command: Any) -> None:
    """Give ``command`` and every command under it a one-line summary (its help's first paragraph): typer's rich
    listing keeps a docstring's line breaks there ("… the other projects' envs each may" / "reach.")."""
    if command.short_help is None and command.help and not command.help.startswith("\b"):
        command.short_help = " ".join(inspect.cleandoc(command.help).split("\n\n")[0].split())
    for sub in getattr(command, "commands", {}).values():
        _one_line_summaries(sub)


app = typer.Typer(
    cls=LazyCommands, no_args_is_help=True, help="Zattera: a self-hosted PaaS control plane on NATS JetStream."
)


def print_version(asked: bool) -> None:
    if asked:
        from shared.version import zattera_version

        print(f"zattera {zattera_version()}")
        raise typer.Exit()


@app.callback()
def root(
    nats: str = typer.Option("", "--nats", envvar="ZATTERA_NATS_URL", help="NATS URL(s), comma-separated"),
    version: bool = typer.Option(
        False, "--version", callback=print_version, is_eager=True, help="print the installed version and exit"
    ),
) -> None:
    """Zattera: a self-hosted PaaS control plane on NATS JetStream."""
    apply_root_options(nats)


__all__ = ["app"]
