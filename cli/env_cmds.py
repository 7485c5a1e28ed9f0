"""Operating environments: ``zattera apps|envs|projects delete``, ``zattera scale`` and ``zattera status``.

Deleting and scaling are operator actions (:mod:`shared.actions.deletion`, :mod:`shared.actions.envs`); a
deletion needs ``--yes``, or a confirmation typed at a terminal: without a terminal (scripts, CI) it is
refused.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import ExitCode, control, err, fail, run
from shared import keys as K
from shared.actions.deletion import Delete, Scope, delete, plan_delete
from shared.actions.envs import Scale, Scaled
from shared.actions.envs import scale as scale_env
from shared.actions.names import env_path, target_env
from shared.backup.status import BackupStatus, backup_status, describe
from shared.deployments import desired_replicas, is_terminal
from shared.live import proxy_reports
from shared.notify_status import failing_channels
from shared.state.reader import StateReader
from shared.urls import proxy_listeners, urls_by_env

envs_app = typer.Typer(no_args_is_help=True, help="Environments: delete.")
projects_app = typer.Typer(no_args_is_help=True, help="Projects: delete.")

JSON = typer.Option(False, "--json", help="machine-readable output")
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
    _delete(Delete(Scope.ENV, env, volumes), yes=yes, as_json=json)


@projects_app.command("delete")
def projects_delete(
    project: str = typer.Argument(..., help="project id or name"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete a project with all its apps and environments (see `zattera apps delete`)."""
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
    request = Scale(env, replicas, minimum, maximum)

    async def go() -> Scaled:
        async with control() as c:
            return await scale_env(c.actions, request)

    done = run(go)
    if json:
        render.emit_json({"env": done.env, "replicas": done.replicas, "min": done.minimum, "max": done.maximum})
        return
    err.print(done.message)


# ---------------------------------------------------------------------------------------------- status


UP_STATES = frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY})


def env_status(view: StateReader, env: pb.Environment, urls: list[str]) -> dict[str, Any]:
    """One env's overview: where it answers (``urls``: :func:`shared.urls.urls_by_env`), what runs, whether it
    is warm, how its last deploy went.
    Running and healthy count the active release's replicas; ``kept_warm``: other releases' replicas
    still running (a previous release kept warm during a drain window)."""
    release = view.release(env.active_release_id) if env.active_release_id else None
    runs = [a for a in view.assignments(env.meta.id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN and not a.job_id]
    replicas = [a for a in runs if a.release_id == env.active_release_id]
    desired = desired_replicas(env)
    deployments = view.deployments(env.meta.id)
    last = max(deployments, key=lambda d: (d.meta.created_at.ToNanoseconds(), d.meta.id), default=None)
    if not env.active_release_id:
        state = "not deployed"
    elif desired == 0:
        state = "cold"
    else:
        state = "warm"
    last_deploy: dict[str, str] | None = None
    if last is not None:
        last_release = view.release(last.release_id)
        last_deploy = {
            "id": last.meta.id,
            "release": f"v{last_release.version}" if last_release else "?",
            "phase": render.enum_name(pb.DeploymentPhase, last.phase, "DEPLOYMENT_PHASE_"),
            "created_at": render.ts(last.meta.created_at),
            "error": last.error,
        }
    return {
        "env": env_path(view, env),
        "id": env.meta.id,
        "placement": placement_status(view, env),
        "urls": urls,
        "active_release": f"v{release.version}" if release else "",
        "active_release_id": env.active_release_id,
        "desired": desired,
        "running": sum(1 for a in replicas if a.observed.state in UP_STATES),
        "healthy": sum(1 for a in replicas if a.observed.state == pb.INSTANCE_STATE_HEALTHY),
        "state": state,
        "kept_warm": len(runs) - len(replicas),
        "deploying": any(not is_terminal(d.phase) for d in deployments),
        "last_deploy": last_deploy,
    }


def placement_status(view: StateReader, env: pb.Environment) -> dict[str, Any] | None:
    """Why replicas of the active release have no node (None: none is missing): every node counted under
    the first named placement filter it fails (shared/placement/placement.py ``FILTERS``), as the
    scheduler sees it."""
    release = view.release(env.active_release_id) if env.active_release_id else None
    if release is None:
        return None
    placed = sum(
        1
        for a in view.assignments(env.meta.id)
        if a.desired == pb.ASSIGNMENT_DESIRED_RUN and not a.job_id and a.release_id == release.meta.id
    )
    unplaced = desired_replicas(env) - placed
    if unplaced <= 0:
        return None
    from shared.placement.explain import explain

    why = explain(view, release, env.meta.id)
    return {
        "unplaced": unplaced,
        "nodes": why.nodes,
        "filtered": why.filtered,
        "with_room": why.fit,
        "why": why.summary(),
    }


def print_unplaced(statuses: list[dict[str, Any]]) -> None:
    """One line per env short of replicas: how many, and why."""
    for row in statuses:
        placement = row["placement"]
        if placement is not None:
            count = placement["unplaced"]
            text = f"{row['env']}: {count} replica{'s' * (count != 1)} unplaced — {placement['why']}"
            render.out.print(text, markup=False, highlight=False)


def status(
    env: str = typer.Option("", "--env", help="only this environment (id or project/app/env)"), json: bool = JSON
) -> None:
    """Per environment: its URLs, active release, replicas desired/running/healthy, cold or warm, its
    last deploy, and why replicas that found no node are unplaced."""
    from cli.watch import route_snapshot

    backups: list[BackupStatus] = []
    channels: list[str] = []

    async def go() -> list[dict[str, Any]]:
        async with control() as c:
            envs = [target_env(c.view, env)] if env else c.view.envs()
            routes, proxies = await asyncio.gather(
                route_snapshot(c.conn, timeout=2.0), proxy_reports(c.conn, time.time())
            )
            certificates = {cert.hostname: cert for cert in c.view.all(K.CERT) if isinstance(cert, pb.Certificate)}
            urls = urls_by_env(routes, proxy_listeners(proxies), certificates, time.time())
            backups.append(backup_status(c.view))
            channels.extend(failing_channels(c.view))
            return [env_status(c.view, e, urls.get(e.meta.id, [])) for e in envs]

    rows = run(go)
    if json:
        render.emit_json(rows)
        return
    table = []
    for row in rows:
        last = row["last_deploy"]
        table.append(
            [
                row["env"],
                "\n".join(row["urls"]) or "-",
                row["active_release"] or "-",
                row["desired"],
                row["running"],
                row["healthy"],
                row["state"],
                f"{last['release']} {last['phase']} {last['created_at']}" if last else "-",
            ]
        )
    render.table("status", ["env", "url", "active", "desired", "running", "healthy", "state", "last deploy"], table)
    print_unplaced(rows)
    if backups and backups[0].failing and not env:
        for line in describe(backups[0]):  # loud until a later backup succeeds (`zattera backup status`)
            render.out.print(line, markup=False, highlight=False, style="bold red" if "FAILING" in line else None)
    for line in [] if env else channels:  # loud until a delivery succeeds (`zattera notify list`)
        render.out.print(line, markup=False, highlight=False, style="bold red")
