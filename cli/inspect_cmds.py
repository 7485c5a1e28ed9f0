"""``zattera ps`` and ``zattera routes``: what runs where, and what the proxies route to."""

from __future__ import annotations

import typer
from zattera.v1 import types_pb2 as pb

from cli import reads, render
from cli.client import control, fail, run
from cli.options import JSON, WIDE, set_output
from cli.render import Col
from shared import keys as K


def ps(env: str = typer.Option("", "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """Assignments (replicas) with their desired and observed state."""
    reads.ps(env, json, wide)


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
