"""``zattera nodes list|cordon|uncordon|drain|label|join-token``: the cluster's machines.

What each change does to a node record is decided by :func:`shared.node_changes.change_node`; this module
reads the view, commits the edited record (fenced) and announces the change as an event.
"""

from __future__ import annotations

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, err, fail, run
from cli.edits import commit_edit
from cli.events_cmds import publish_node_change
from cli.machine_cmds import nodes_remove
from cli.options import JSON, WIDE, set_output
from cli.render import Col
from cli.security_cmds import join_token
from shared import keys as K
from shared.node_changes import NodeChange, NodeChangeRefused, change_node

nodes_app = typer.Typer(no_args_is_help=True, help="Machines: list, label, cordon, drain.")
nodes_app.command("join-token")(join_token)
nodes_app.command("remove")(nodes_remove)


@nodes_app.command("list")
def nodes_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Every registered node with its status, capacity and reservations."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            nodes = c.view.nodes()
            if render.json_mode():
                render.messages(nodes)
                return
            rows = []
            for n in nodes:
                cpu, mem = c.view.reserved(n.meta.id)
                rows.append(
                    [
                        n.meta.id,
                        n.name,
                        render.enum_name(pb.NodeStatus, n.status, "NODE_STATUS_"),
                        "yes" if n.schedulable else "cordoned",
                        n.os_arch,
                        n.runtime or "process",
                        f"{cpu}/{n.capacity.cpu_millis or '∞'} m",
                        f"{mem}/{n.capacity.memory_mb or '∞'} MB",
                        ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())),
                        n.runtime_reason,
                    ]
                )
            render.table(
                "nodes",
                [
                    "id",
                    "name",
                    "status",
                    "schedulable",
                    "platform",
                    "runtime",
                    "cpu",
                    "memory",
                    Col("labels", wrap=True),
                    Col("runtime because", wrap=True, wide=True),
                ],
                rows,
            )

    run(go)


def _edit_node(node_id: str, change: NodeChange, labels: dict[str, str] | None = None) -> None:
    async def go() -> None:
        async with control() as c:
            decided_on: list[tuple[pb.Node, int]] = []

            def edit() -> pb.Node | None:
                node = c.view.node(node_id)
                if node is None:
                    raise fail(f"node {node_id!r} not found")
                decided_on[:] = [(node, c.view.rev(K.node(node_id)))]
                try:
                    edited = change_node(node, change, labels)
                except NodeChangeRefused as exc:
                    raise fail(str(exc)) from None
                if edited is None:
                    err.print(
                        f"node {node_id} is {render.enum_name(pb.NodeStatus, node.status, 'NODE_STATUS_')}:"
                        " nothing to do"
                    )
                return edited

            edited = await commit_edit(c, f"node {node_id}", edit)
            if isinstance(edited, pb.Node):
                await publish_node_change(c.conn, *decided_on[0], edited)
                err.print(f"node {node_id}: {change} done")

    run(go)


@nodes_app.command("cordon")
def nodes_cordon(node_id: str) -> None:
    """Stop placing new replicas on a node (running ones stay)."""
    _edit_node(node_id, NodeChange.CORDON)


@nodes_app.command("uncordon")
def nodes_uncordon(node_id: str) -> None:
    """Make a node schedulable again."""
    _edit_node(node_id, NodeChange.UNCORDON)


@nodes_app.command("drain")
def nodes_drain(node_id: str) -> None:
    """Move every replica off a node, then mark it DRAINED."""
    _edit_node(node_id, NodeChange.DRAIN)


@nodes_app.command("label")
def nodes_label(node_id: str, labels: list[str] = typer.Argument(..., help="key=value (key= removes)")) -> None:
    """Set or remove node labels (used by placement constraints and region spread)."""
    parsed: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"labels: {item!r} is not key=value")
        parsed[key] = value
    _edit_node(node_id, NodeChange.LABEL, parsed)
