"""``zattera ps`` and ``zattera routes``: what runs where, and what the proxies route to."""

from __future__ import annotations

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, fail, run
from cli.env_cmds import placement_status, print_unplaced
from cli.options import JSON, WIDE, env_or_fail, set_output
from cli.render import Col
from shared import keys as K
from shared.actions.names import env_label
from shared.applogs import describe_exit
from shared.deployments import replica_role


def ps(env: str = typer.Option("", "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """Assignments (replicas) with their desired and observed state."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            target = env_or_fail(c.view, env) if env else None
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


def routes(json: bool = JSON, wide: bool = WIDE) -> None:
    """The current route snapshot, as the proxies see it."""
    set_output(json, wide)
    from cli.watch import fetch_routes

    snapshot = run(fetch_routes)
    if snapshot is None:
        raise fail("no route snapshot yet (is the routes service running?)")
    if render.json_mode():
        render.emit_json(render.as_dict(snapshot))
        return
    projects = run(_project_names)
    rows = []
    for r in snapshot.http_routes:
        endpoints = ", ".join(f"{e.addr}" for e in r.endpoints)
        replicas = ", ".join(f"{e.node_id}/{e.assignment_id}" for e in r.endpoints)
        env_name = f"{projects.get(r.project_id, r.project_id)}/{r.app_name}/{r.environment_name}"
        rows.append([r.hostname, r.path_prefix or "/", env_name, endpoints or "(none)", r.environment_id, replicas])
    render.table(
        f"routes (version {snapshot.version})",
        ["host", "path", "env", "endpoints", Col("env id", wide=True), Col("replicas", wide=True)],
        rows,
    )


async def _project_names() -> dict[str, str]:
    async with control() as c:
        return {p.meta.id: p.name for p in c.view.all(K.PROJECT) if isinstance(p, pb.Project)}
