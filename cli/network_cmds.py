"""``zattera network``: every env's private address and name, its ports, and who may reach it
(docs/networking.md)."""

from __future__ import annotations

from typing import Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import OPTIONS, control, fail, run
from services.agent.network import served_port
from shared.actions.names import env_path, resolve_env
from shared.state.reader import StateReader


def _entry(view: StateReader, env: pb.Environment, vip: str) -> dict[str, Any]:
    project, app, name = env_path(view, env).split("/")
    return {
        "env": f"{project}/{app}/{name}",
        "env_id": env.meta.id,
        "name": f"{app}.{name}.{project}.internal",
        "vip": vip,
        "ports": [
            {"name": port.name, "port": served_port(port.name, port.container_port)}
            for port in env.service.ports
            if served_port(port.name, port.container_port)
        ],
        "scale_to_zero": env.service.scale_to_zero,
        "allow": list(env.service.network.allow),
    }


def network(
    env: str = typer.Option("", "--env", help="only this env (id or project/app/env)"),
    json_output: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Envs' private addresses: name, VIP, ports, and the other projects' envs each may reach."""
    OPTIONS.json = json_output

    async def go() -> list[dict[str, Any]]:
        async with control() as c:
            only = None
            if env:
                found = resolve_env(c.view, env)
                if found is None:
                    raise fail(f"--env: no environment {env!r} (use an id or project/app/env)")
                only = found.meta.id
            entries = []
            for vip in sorted(c.view.vips(), key=lambda v: v.environment_id):
                target = c.view.env(vip.environment_id)
                if target is not None and vip.vip and only in (None, vip.environment_id):
                    entries.append(_entry(c.view, target, vip.vip))
            return sorted(entries, key=lambda e: e["env"])

    entries = run(go)
    if json_output:
        render.emit_json(entries)
        return
    render.table(
        "private network (docs/networking.md)",
        ["NAME", "ENV", "VIP", "PORTS", "SCALE TO ZERO", "MAY ALSO REACH", render.Col("ENV ID", wide=True)],
        [
            (
                e["name"],
                e["env"],
                e["vip"],
                ", ".join(f"{p['name']}:{p['port']}" for p in e["ports"]) or "-",
                "yes" if e["scale_to_zero"] else "no",
                ", ".join(e["allow"]) or "-",
                e["env_id"],
            )
            for e in entries
        ],
    )
