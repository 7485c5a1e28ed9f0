"""Operating environments: ``zattera apps|envs|projects delete``, ``zattera scale`` and ``zattera status``
(shown by :func:`cli.reads.status`).

Deleting and scaling are operator actions (:mod:`shared.actions.deletion`, :mod:`shared.actions.envs`); a
deletion needs ``--yes``, or a confirmation typed at a terminal: without a terminal (scripts, CI) it is
refused.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import typer

from cli import reads, render
from cli.client import ExitCode, control, err, fail, on_cluster, run
from cli.options import JSON

if TYPE_CHECKING:  # the actions load when a command deletes or scales (a plain `status` imports neither)
    from shared.actions.deletion import Delete

envs_app = typer.Typer(no_args_is_help=True, help="Environments: delete.")
projects_app = typer.Typer(no_args_is_help=True, help="Projects: delete.")

YES = typer.Option(False, "--yes", "-y", help="do not ask for confirmation (required without a terminal)")
VOLUMES = typer.Option(False, "--volumes", help="also delete the volumes and their snapshots (kept by default)")


# ---------------------------------------------------------------------------------------------- delete


def _describe(what: str, counts: dict[str, int]) -> str:
    parts = [
        f"{counts['environments']} environment(s)",
        f"{counts['replicas_stopped']} running replica(s)",
        f"{counts['domains']} domain(s)",
    ]
    if counts["volumes_deleted"]:
        parts.append(f"{counts['volumes_deleted']} volume(s) and {counts['snapshots_deleted']} snapshot(s)")
    text = f"{what}: " + ", ".join(parts)
    if counts["volumes_kept"]:
        text += f"; keeps {counts['volumes_kept']} volume(s) and their snapshots (--volumes deletes them)"
    return text


def confirm(what: str, counts: dict[str, int], yes: bool) -> None:
    """Go on with ``--yes`` or a typed confirmation; refuse without a terminal to ask at."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise fail(f"deleting {what} needs confirmation: pass --yes (no terminal to ask at)", ExitCode.USAGE)
    err.print(f"about to delete {_describe(what, counts)}")
    if not typer.confirm(f"Delete {what}?", default=False, err=True):
        raise fail("not deleted")


def _delete(request: Delete, *, yes: bool, as_json: bool) -> None:
    """Show what goes and confirm, then delete (:func:`shared.actions.deletion.delete`) and report."""
    from shared.actions.deletion import delete, plan_delete

    async def go() -> None:
        async with control() as c:
            plan = plan_delete(c.view, request, time.time())
            if plan is None:
                raise fail(f"{request.scope} {request.ref!r}: not found")
            confirm(plan.what, plan.summary(), yes)
            done = await delete(c.actions, request)
            if as_json:
                render.emit_json({"deleted": done.what, **done.counts})
                return
            err.print(f"deleted {_describe(done.what, done.counts)}")

    run(go)


def apps_delete(
    app: str = typer.Argument(..., help="app id or project/app"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete an app and its environments: stops every replica, removes routes and domains; releases and
    images go through retention. Volumes and snapshots are kept unless --volumes."""
    from shared.actions.deletion import Delete, Scope

    _delete(Delete(Scope.APP, app, volumes), yes=yes, as_json=json)


@envs_app.command("delete")
def envs_delete(
    env: str = typer.Argument(..., help="environment id or project/app/env"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete an environment: stops every replica, removes its routes and domains; releases and images go
    through retention. Volumes and snapshots are kept unless --volumes."""
    from shared.actions.deletion import Delete, Scope

    _delete(Delete(Scope.ENV, env, volumes), yes=yes, as_json=json)


@projects_app.command("delete")
def projects_delete(
    project: str = typer.Argument(..., help="project id or name"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete a project with all its apps and environments (see `zattera apps delete`)."""
    from shared.actions.deletion import Delete, Scope

    _delete(Delete(Scope.PROJECT, project, volumes), yes=yes, as_json=json)


# ---------------------------------------------------------------------------------------------- scale


def scale(
    replicas: int | None = typer.Argument(None, help="a fixed replica count (min = max = REPLICAS)"),
    env: str = typer.Option(..., "--env", help="environment id or project/app/env"),
    minimum: int | None = typer.Option(None, "--min", help="lower bound the autoscaler keeps"),
    maximum: int | None = typer.Option(None, "--max", help="upper bound the autoscaler keeps"),
    json: bool = JSON,
) -> None:
    """Set an environment's replica count (REPLICAS) or its autoscaling bounds (--min/--max). The next
    `zattera apps apply` sets the bounds from zattera.toml again."""
    from shared.actions.envs import Scale
    from shared.actions.envs import scale as scale_env

    request = Scale(env, replicas, minimum, maximum)

    done = on_cluster(scale_env, request)
    if json:
        render.emit_json({"env": done.env, "replicas": done.replicas, "min": done.minimum, "max": done.maximum})
        return
    err.print(done.message)


# ---------------------------------------------------------------------------------------------- status


def status(
    env: str = typer.Option("", "--env", help="only this environment (id or project/app/env)"), json: bool = JSON
) -> None:
    """Per environment: its URLs, active release, replicas desired/running/healthy, cold or warm, its
    last deploy, and why replicas that found no node are unplaced."""
    reads.status(env, json)
