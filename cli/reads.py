"""The plain reads, ``zattera status`` and ``zattera ps``, without typer: :func:`cli.main.main` runs them
directly when the command line is one they take (PERFORMANCE.md "CLI start-up"), and their typer commands
(:mod:`cli.env_cmds`, :mod:`cli.inspect_cmds`) call them for help, errors and every other spelling. Nothing
here imports typer, nor anything a read does not use.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, run
from cli.render import Col
from shared import keys as K
from shared.actions.names import env_label, env_path, target_env
from shared.backup.status import BackupStatus, backup_status, describe
from shared.deployments import desired_replicas, is_terminal, replica_role
from shared.drain_status import status_lines
from shared.live import proxy_reports
from shared.notify_status import failing_channels
from shared.state.reader import StateReader
from shared.urls import proxy_listeners, urls_by_env

UP_STATES = frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY})


def commit_of(release: pb.Release | None) -> dict[str, str]:
    """The git commit a release was built from (empty strings when not from git; docs/git.md)."""
    source = release.source if release is not None else pb.ReleaseSource()
    return {
        "sha": source.git_sha,
        "ref": source.git_ref or (f"refs/heads/{source.git_branch}" if source.git_branch else ""),
        "author": source.git_author,
        "message": source.git_message,
    }


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
            "commit": commit_of(last_release)["sha"][:12],
        }
    return {
        "env": env_path(view, env),
        "id": env.meta.id,
        "placement": placement_status(view, env),
        "urls": urls,
        "active_release": f"v{release.version}" if release else "",
        "active_release_id": env.active_release_id,
        "commit": commit_of(release),
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


def status(env: str = "", as_json: bool = False) -> None:
    """``zattera status [--env ENV] [--json]`` (:func:`cli.env_cmds.status` is its typer command)."""
    from cli.watch import route_snapshot

    backups: list[BackupStatus] = []
    channels: list[str] = []
    drain_lines: list[tuple[str, bool]] = []

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
            drain_lines.extend(status_lines(c.view))
            return [env_status(c.view, e, urls.get(e.meta.id, [])) for e in envs]

    rows = run(go)
    if as_json:
        render.emit_json(rows)
        return
    table = []
    for row in rows:
        last = row["last_deploy"]
        table.append(
            [
                row["env"],
                "\n".join(row["urls"]) or "-",
                " ".join(x for x in (row["active_release"], row["commit"]["sha"][:12]) if x) or "-",
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
    for text, bad in [] if env else drain_lines:  # `zattera drains list`
        render.out.print(text, markup=False, highlight=False, style="bold red" if bad else None)


def ps(env: str = "", as_json: bool = False, wide: bool = False) -> None:
    """``zattera ps [--env ENV] [--json] [--wide]`` (:func:`cli.inspect_cmds.ps` is its typer command)."""
    from shared.applogs import describe_exit  # with the log shipping's modules: `ps` only

    render.set_output(as_json, wide)

    async def go() -> None:
        async with control() as c:
            target = target_env(c.view, env) if env else None
            items = c.view.assignments(target.meta.id if target else None)
            if render.json_mode():
                render.messages(items)
                return
            rows = []
            for a in items:
                release = c.view.release(a.release_id)
                ports = ",".join(f"{k}:{v}" for k, v in sorted(a.observed.mesh_port_bindings.items()))
                rows.append(
                    [
                        a.meta.id,
                        env_label(c.view, a.environment_id),
                        f"v{release.version}" if release else "?",
                        a.node_id,
                        render.enum_name(pb.AssignmentDesired, a.desired, "ASSIGNMENT_DESIRED_"),
                        render.enum_name(pb.InstanceState, a.observed.state, "INSTANCE_STATE_"),
                        replica_role(c.view, a),
                        a.observed.restarts,
                        describe_exit(a.observed.last_exit) if a.observed.HasField("last_exit") else "",
                        ports,
                        a.observed.message,
                    ]
                )
            render.table(
                "assignments",
                [
                    Col("id", wide=True),
                    "env",
                    "release",
                    "node",
                    "desired",
                    "observed",
                    "traffic",
                    "restarts",
                    "last exit",
                    "ports",
                    Col("message", wrap=True),
                ],
                rows,
            )
            envs = [target] if target else c.view.envs()
            print_unplaced(
                [{"env": env_label(c.view, e.meta.id), "placement": placement_status(c.view, e)} for e in envs]
            )

    run(go)
