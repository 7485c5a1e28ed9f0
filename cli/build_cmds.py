"""``zattera build plan DIR``: what a build of DIR would install, build and start (shared/buildplan.py), without
building, like ``nixpacks plan``. The same lines open every build log."""

from __future__ import annotations

from pathlib import Path

import typer

from cli import render
from cli.client import fail
from cli.options import JSON, set_output
from shared.buildplan import PlanError, detect, read_source

build_app = typer.Typer(no_args_is_help=True, help="Source builds: the detected plan.")


@build_app.command("plan")
def plan(
    directory: Path = typer.Argument(..., help="the app's source directory"),
    json: bool = JSON,
) -> None:
    """Print the build plan (provider, install, build, start) detected for DIR."""
    set_output(json)
    if not directory.is_dir():
        raise fail(f"DIR {str(directory)!r}: not a directory")
    try:
        detected = detect(read_source(directory))
    except PlanError as exc:
        raise fail(str(exc)) from None
    if render.json_mode():
        render.emit_json(detected.as_json())
    else:
        for line in detected.lines():
            typer.echo(line)
    if detected.error:
        raise typer.Exit(1)
