"""``zattera network``: every env's private name, the address apps reach it at, its ports, and who may reach it
(docs/networking.md). The VIP is the env's identity (loopback, nothing listens on it): an app reaches env
``a.b`` at its own address ``127.(128+c).a.b``, ``c`` being the app's slot on its node, so the table shows that
form and the VIP only with ``--wide``."""

from __future__ import annotations

from typing import Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, fail, run
from cli.options import JSON, WIDE, set_output
from services.agent.network import served_port
from shared.actions.names import env_path, resolve_env
from shared.state.reader import StateReader

NOTE = (
    "An app reaches an env at its own address 127.(128+c).a.b (c: the app's slot on its node), told to it as "
    "ZATTERA_SERVICE_<APP>_<ENV>_HOST and answered for NAME by its resolver ZATTERA_DNS. The VIP (--wide) names "
    "the env: a loopback address nothing listens on."
)


def app_address(vip: str) -> str:
    """How every app addresses the env holding ``vip``: ``127.(128+c).a.b`` (``a.b``: the VIP's host part)."""
    return f"127.(128+c).{vip.split('.', 2)[-1]}"


def _entry(view: StateReader, env: pb.Environment, vip: str) -> dict[str, Any]:
    project, app, name = env_path(view, env).split("/")
    return {
        "env": f"{project}/{app}/{name}",
        "env_id": env.meta.id,
        "name": f"{app}.{name}.{project}.internal",
        "vip": vip,
        "app_address": app_address(vip),
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
    json_output: bool = JSON,
    wide: bool = WIDE,
) -> None:
    """Envs' private names, the address apps reach each at, its ports, and the other projects' envs each may
    reach."""
    set_output(json_output, wide)

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
        [
            "NAME",
            "ENV",
            "APPS REACH IT AT",
            "PORTS",
            "SCALE TO ZERO",
            "MAY ALSO REACH",
            render.Col("VIP", wide=True),
            render.Col("ENV ID", wide=True),
        ],
        [
            (
                e["name"],
                e["env"],
                e["app_address"],
                ", ".join(f"{p['name']}:{p['port']}" for p in e["ports"]) or "-",
                "yes" if e["scale_to_zero"] else "no",
                ", ".join(e["allow"]) or "-",
                e["vip"],
                e["env_id"],
            )
            for e in entries
        ],
    )
    if entries:
        render.out.print(NOTE, markup=False, highlight=False)
