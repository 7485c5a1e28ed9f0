"""Operating environments: ``zattera apps|envs|projects delete``, ``zattera scale`` and ``zattera status``.

Deletions are planned by :mod:`cli.deletion` and committed as one fenced batch; a concurrent write to
anything the plan read refuses it whole, and it is decided again on fresh state. A deletion needs
``--yes``, or a confirmation typed at a terminal: without a terminal (scripts, CI) it is refused.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, err, run
from shared import keys as K
from shared.clock import RealClock
from shared.deployments import desired_replicas, is_terminal
from shared.events import EventPublisher, event_for_env
from shared.live import proxy_reports
from shared.names import env_path, find_app, find_project, resolve_env
from shared.state.reader import StateReader
from shared.urls import proxy_listeners, urls_by_env

if TYPE_CHECKING:  # the writes' modules load with a write command, not with `zattera status`
    from cli.deletion import Deletion

envs_app = typer.Typer(no_args_is_help=True, help="Environments: delete.")
projects_app = typer.Typer(no_args_is_help=True, help="Projects: delete.")

JSON = typer.Option(False, "--json", help="machine-readable output")
YES = typer.Option(False, "--yes", "-y", help="do not ask for confirmation (required without a terminal)")
VOLUMES = typer.Option(False, "--volumes", help="also delete the volumes and their snapshots (kept by default)")


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print("[red]error:[/] ", end="")
    err.print(message, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


# ---------------------------------------------------------------------------------------------- delete


def _find_app(view: StateReader, ref: str) -> pb.App | None:
    """An app by id or by ``project/app`` names."""
    found = view.app(ref)
    if found is not None:
        return found
    project_name, sep, app_name = ref.partition("/")
    project = find_project(view, project_name) if sep else None
    return find_app(view, project.meta.id, app_name) if project else None


def _find_project(view: StateReader, ref: str) -> pb.Project | None:
    return view.project(ref) or find_project(view, ref)


def _describe(plan: Deletion) -> str:
    parts = [
        f"{len(plan.envs)} environment(s)",
        f"{len(plan.stops)} running replica(s)",
        f"{len(plan.domains)} domain(s)",
    ]
    if plan.volumes:
        parts.append(f"{len(plan.volumes)} volume(s) and {len(plan.snapshots)} snapshot(s)")
    text = f"{plan.what}: " + ", ".join(parts)
    if plan.kept_volumes:
        text += f"; keeps {len(plan.kept_volumes)} volume(s) and their snapshots (--volumes deletes them)"
    return text


def confirm(plan: Deletion, yes: bool) -> None:
    """Go on with ``--yes`` or a typed confirmation; refuse without a terminal to ask at."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise fail(f"deleting {plan.what} needs confirmation: pass --yes (no terminal to ask at)", code=2)
    err.print(f"about to delete {_describe(plan)}")
    if not typer.confirm(f"Delete {plan.what}?", default=False, err=True):
        raise fail("not deleted", code=1)


def _plan_deletion(view: StateReader, what: str, **scope: Any) -> Deletion:
    """:func:`cli.deletion.plan_deletion`, loaded with a delete command (not with `zattera status`)."""
    from cli.deletion import plan_deletion

    return plan_deletion(view, what, **scope)


def _delete(what: str, decide: Callable[[StateReader, float], Deletion | None], *, yes: bool, as_json: bool) -> None:
    from cli.deletion import deletion_events, deletion_txn
    from shared.retry import Attempt, RetriesExhausted, commit_with_retry

    """Decide on the view, confirm, commit as one fenced batch (deciding again after a conflict), publish
    the events and report."""

    async def go() -> None:
        async with control() as c:
            plan = decide(c.view, time.time())
            if plan is None:
                raise fail(f"{what}: not found")
            confirm(plan, yes)

            def attempt() -> Attempt[Deletion]:
                fresh = decide(c.view, time.time())
                if fresh is None:
                    raise fail(f"{what}: deleted meanwhile by someone else")
                return Attempt(deletion_txn(c.writer, fresh), fresh)

            try:
                plan = await commit_with_retry(c.writer, attempt, clock=RealClock(), contended=what)
            except RetriesExhausted:
                raise fail(f"{what} kept changing while deleting; try again") from None
            await EventPublisher(c.conn).publish(*deletion_events(plan))
            if as_json:
                render.emit_json({"deleted": plan.what, **plan.summary()})
                return
            err.print(f"deleted {_describe(plan)}")

    run(go)


def apps_delete(
    app: str = typer.Argument(..., help="app id or project/app"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete an app and its environments: stops every replica, removes routes and domains; releases and
    images go through retention. Volumes and snapshots are kept unless --volumes."""

    def decide(view: StateReader, now: float) -> Deletion | None:
        found = _find_app(view, app)
        if found is None:
            return None
        project = view.project(found.project_id)
        label = f"app {project.name if project else '?'}/{found.name}"
        return _plan_deletion(view, label, apps=[found], volumes=volumes, now=now)

    _delete(f"app {app!r}", decide, yes=yes, as_json=json)


@envs_app.command("delete")
def envs_delete(
    env: str = typer.Argument(..., help="environment id or project/app/env"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete an environment: stops every replica, removes its routes and domains; releases and images go
    through retention. Volumes and snapshots are kept unless --volumes."""

    def decide(view: StateReader, now: float) -> Deletion | None:
        found = resolve_env(view, env)
        if found is None:
            return None
        return _plan_deletion(view, f"env {env_path(view, found)}", envs=[found], volumes=volumes, now=now)

    _delete(f"env {env!r}", decide, yes=yes, as_json=json)


@projects_app.command("delete")
def projects_delete(
    project: str = typer.Argument(..., help="project id or name"),
    yes: bool = YES,
    volumes: bool = VOLUMES,
    json: bool = JSON,
) -> None:
    """Delete a project with all its apps and environments (see `zattera apps delete`)."""

    def decide(view: StateReader, now: float) -> Deletion | None:
        found = _find_project(view, project)
        if found is None:
            return None
        return _plan_deletion(view, f"project {found.name}", projects=[found], volumes=volumes, now=now)

    _delete(f"project {project!r}", decide, yes=yes, as_json=json)


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
    from shared.retry import Attempt, RetriesExhausted, commit_with_retry
    from shared.scaling import ScaleRequest, scaled

    request = ScaleRequest(replicas, minimum, maximum)
    problem = request.problem()
    if problem:
        raise fail(problem)

    async def go() -> None:
        async with control() as c:

            def attempt() -> Attempt[pb.Environment]:
                target = resolve_env(c.view, env)
                if target is None:
                    raise fail(f"--env: no environment {env!r} (use an id or project/app/env)")
                try:
                    new = scaled(target, request)
                except ValueError as exc:
                    raise fail(str(exc)) from None
                new.meta.updated_at.FromNanoseconds(time.time_ns())
                return Attempt(c.writer.txn("scale").put(new), new)

            try:
                new = await commit_with_retry(c.writer, attempt, clock=RealClock(), contended=f"env {env}")
            except RetriesExhausted:
                raise fail(f"env {env} kept changing while scaling; try again") from None
            path = env_path(c.view, new)
            bounds = f"min {new.service.replicas.min}, max {new.service.replicas.max}"
            message = f"scaled {path} to {new.effective_replicas} replica(s) ({bounds})"
            await EventPublisher(c.conn).publish(event_for_env(new, "env.scaled", message, fields={"actor": "cli"}))
            if json:
                render.emit_json(
                    {
                        "env": path,
                        "replicas": new.effective_replicas,
                        "min": new.service.replicas.min,
                        "max": new.service.replicas.max,
                    }
                )
                return
            err.print(message)

    run(go)


# ---------------------------------------------------------------------------------------------- status


UP_STATES = frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY})


def env_status(view: StateReader, env: pb.Environment, urls: list[str]) -> dict[str, Any]:
    """One env's overview: where it answers (``urls``: :func:`shared.urls.urls_by_env`), what runs, whether it
    is warm, how its last deploy went. Running and healthy count the active release's replicas;
    ``kept_warm``: other releases' replicas still running (a previous release kept warm during a drain window)."""
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
    from shared.placement.placement import explain  # only for an env short of replicas

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

    async def go() -> list[dict[str, Any]]:
        async with control() as c:
            if env:
                target = resolve_env(c.view, env)
                if target is None:
                    raise fail(f"--env: no environment {env!r} (use an id or project/app/env)")
                envs = [target]
            else:
                envs = c.view.envs()
            routes, proxies = await asyncio.gather(
                route_snapshot(c.conn, timeout=2.0), proxy_reports(c.conn, time.time())
            )
            certificates = {cert.hostname: cert for cert in c.view.all(K.CERT) if isinstance(cert, pb.Certificate)}
            urls = urls_by_env(routes, proxy_listeners(proxies), certificates, time.time())
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
