"""An operator's change to a node — cordon, uncordon, drain, label, remove (``zattera nodes``, the console's
node buttons).

:func:`change_node` is the pure decision (the node record after the change); :func:`edit_node` commits it
with one fenced write, deciding again when a concurrent write wins (heartbeats land meanwhile), and
announces a status change. The scheduler acts on the result: it places nothing on an unschedulable node,
and moves every replica off a DRAINING one, then marks it DRAINED.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from nats.errors import Error as NatsError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit_edit
from shared.actions.refusals import Conflicting, NotFound, Unavailable
from shared.events import node_change_event, node_status_name

REMOVE_TIMEOUT = 30.0
"""How long the join service is given to peer-remove a machine's server and revoke its credentials."""


class NodeChange(StrEnum):
    CORDON = "cordon"
    """No new replicas (running ones stay)."""
    UNCORDON = "uncordon"
    """Schedulable again, and ALIVE (ends a drain)."""
    DRAIN = "drain"
    """No new replicas, and the running ones move off (DRAINING, then DRAINED)."""
    LABEL = "label"
    """Set or remove labels (placement constraints, region spread)."""


@dataclass(frozen=True, slots=True)
class EditNode:
    node_id: str
    change: NodeChange
    labels: dict[str, str] = field(default_factory=dict)
    """LABEL only: key → value; an empty value removes the key."""


@dataclass(frozen=True, slots=True)
class RemoveNode:
    node_id: str
    timeout: float = REMOVE_TIMEOUT


@dataclass(frozen=True, slots=True)
class NodeRemoved:
    node_id: str
    revoked: list[str]
    """The credentials revoked (every one the machine was issued)."""
    peer_removed: bool
    """Its NATS server was removed from the cluster's peers."""


@dataclass(frozen=True, slots=True)
class NodeEdited:
    node_id: str
    change: NodeChange
    written: bool
    """False: nothing to do (cordoning a node that takes no replicas already)."""
    status: str
    """The node's status after the change: ALIVE, DRAINING, …"""


def change_node(node: pb.Node, change: NodeChange, labels: Mapping[str, str] | None = None) -> pb.Node | None:
    """The node record after ``change``: a copy (the view's message is never mutated), or None when there is
    nothing to write — cordoning a node that is DRAINING or DRAINED, which takes no replicas already.
    ``labels`` (LABEL only): key → value; an empty value removes the key. A DOWN node is refused an uncordon:
    it becomes schedulable again by heartbeating, not by an operator's word."""
    if change is NodeChange.CORDON and node.status in (pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED):
        return None
    if change is NodeChange.UNCORDON and node.status == pb.NODE_STATUS_DOWN:
        raise Conflicting(f"node {node.meta.id} is down: it cannot be uncordoned until it heartbeats again")
    edited = pb.Node()
    edited.CopyFrom(node)
    if change is NodeChange.CORDON:
        edited.schedulable = False
    elif change is NodeChange.UNCORDON:
        edited.status = pb.NODE_STATUS_ALIVE
        edited.schedulable = True
    elif change is NodeChange.DRAIN:
        edited.status = pb.NODE_STATUS_DRAINING
        edited.schedulable = False
    else:
        for key, value in (labels or {}).items():
            if value:
                edited.labels[key] = value
            else:
                edited.labels.pop(key, None)
    return edited


async def edit_node(ctx: ActionContext, request: EditNode) -> NodeEdited:
    node_id = request.node_id
    decided_on: list[tuple[pb.Node, int]] = []

    def edit() -> pb.Node | None:
        node = ctx.view.node(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} not found", field="node_id")
        decided_on[:] = [(node, ctx.view.rev(K.node(node_id)))]
        return change_node(node, request.change, request.labels)

    edited = await commit_edit(ctx, f"node {node_id}", edit)
    before, revision = decided_on[0]
    if edited is None:
        return NodeEdited(node_id, request.change, False, node_status_name(before.status))
    event = node_change_event(before, edited, ctx.clock.now(), actor=ctx.actor, revision=revision)
    if event is not None:
        await ctx.events.publish(event)
    return NodeEdited(node_id, request.change, True, node_status_name(edited.status))


async def remove_node(ctx: ActionContext, request: RemoveNode) -> NodeRemoved:
    """Remove a machine (drained first): the join service peer-removes its NATS server, revokes every
    credential it was issued, and deletes its node record."""
    from shared.security.permissions import JOIN_REMOVE_SUBJECT  # the security modules' imports, only when used

    payload = json.dumps({"node_id": request.node_id}).encode()
    try:
        msg = await ctx.conn.nc.request(JOIN_REMOVE_SUBJECT, payload, timeout=request.timeout)
    except (NatsError, TimeoutError):
        raise Unavailable("no join service answered") from None
    reply = json.loads(msg.data or b"{}")
    if "error" in reply:
        raise Conflicting(str(reply["error"]))
    revoked = reply.get("revoked")
    return NodeRemoved(
        request.node_id,
        [str(r) for r in revoked] if isinstance(revoked, list) else [],
        bool(reply.get("peer_removed")),
    )
