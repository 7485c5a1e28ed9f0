"""``zattera nodes list|cordon|uncordon|drain|label|join-token``: the cluster's machines.

Each change is the operator action :func:`shared.actions.nodes.edit_node`: this module parses and prints.
"""

from __future__ import annotations

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, err, fail, on_cluster, run
from cli.machine_cmds import nodes_remove
from cli.options import JSON, WIDE, set_output
from cli.render import Col
from cli.security_cmds import join_token
from shared.actions.nodes import EditNode, NodeChange, edit_node
from shared.provisioning import recorded_config
from shared.skew import node_version_note

nodes_app = typer.Typer(no_args_is_help=True, help="Machines: list, label, cordon, drain.")
nodes_app.command("join-token")(join_token)
nodes_app.command("remove")(nodes_remove)


@nodes_app.command("list")
def nodes_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Every registered node with its status, version (beside it: "behind", one release behind the cluster;
    "too old"; "newer", its control plane not upgraded yet), capacity, reservations and how it isolates apps."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            nodes = c.view.nodes()
            if render.json_mode():
                render.messages(nodes)
                return
            recorded = await recorded_config(c.conn.js)
            cluster = recorded.version if recorded is not None else ""
            rows = []
            for n in nodes:
                cpu, mem = c.view.reserved(n.meta.id)
                note = node_version_note(n.binary_version, cluster)
                rows.append(
                    [
                        n.meta.id,
                        n.name,
                        render.enum_name(pb.NodeStatus, n.status, "NODE_STATUS_"),
                        "yes" if n.schedulable else "cordoned",
                        n.os_arch,
                        n.runtime or "process",
                        f"{n.binary_version or '?'}{f' ({note})' if note else ''}",
                        isolation_text(n),
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
                    "version",
                    Col("isolation", wrap=True),
                    "cpu",
                    "memory",
                    Col("labels", wrap=True),
                    Col("runtime because", wrap=True, wide=True),
                ],
                rows,
            )

    run(go)


def isolation_text(node: pb.Node) -> str:
    """How the node isolates its apps (SECURITY.md "Apps"); "?" for an agent too old to say."""
    if node.isolation == "none":
        return f"none ({node.isolation_problem})" if node.isolation_problem else "none"
    if node.isolation in ("sandbox", "container") and node.isolation_problem:
        return f"{node.isolation}, network not fenced ({node.isolation_problem})"
    return node.isolation or "?"


def _edit_node(node_id: str, change: NodeChange, labels: dict[str, str] | None = None) -> None:
    done = on_cluster(edit_node, EditNode(node_id, change, labels or {}))
    err.print(
        f"node {node_id}: {change} done" if done.written else f"node {node_id} is {done.status.lower()}: nothing to do"
    )


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
