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
from typing import Any

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit_edit
from shared.actions.refusals import Conflicting, NotFound, Unavailable
from shared.events import node_change_event, node_status_name

REMOVE_TIMEOUT = 130.0
"""How long the join service is given to revoke a machine's credentials, peer-remove its NATS servers and wait
for every stream to be back at its copies on the others (60 s)."""
DRAIN_TIMEOUT = 120.0
"""How long a removal waits for the machine's node to be DRAINED (its replicas moved off)."""


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
    force: bool = False
    """Remove a server machine even when the machines left cannot hold every stream's copies."""
    drain_timeout: float = DRAIN_TIMEOUT


@dataclass(frozen=True, slots=True)
class StreamShort:
    """A stream not at its replica count once the machine's servers left (the servers left cannot hold it)."""

    stream: str
    replicas: int
    current: int
    servers: list[str]


@dataclass(frozen=True, slots=True)
class NodeRemoved:
    node_id: str
    revoked: list[str]
    """The credentials revoked (every one the machine was issued or made)."""
    peer_removed: bool
    """Its NATS servers were removed from the cluster's peers."""
    servers: list[str] = field(default_factory=list)
    """The NATS servers peer-removed (the first machine's seats too)."""
    short: list[StreamShort] = field(default_factory=list)
    """Streams left short of their copies (empty: every stream kept its replica count elsewhere)."""
    drained: bool = False
    """The node was drained by this removal (it was not DRAINED or DOWN already)."""


@dataclass(frozen=True, slots=True)
class RetireSeats:
    timeout: float = REMOVE_TIMEOUT


@dataclass(frozen=True, slots=True)
class SeatsRetired:
    node_id: str
    retired: list[str]
    """The seats' server names, peer-removed and stopped by the first machine's ``zattera up``."""
    short: list[StreamShort] = field(default_factory=list)


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
    """Remove a machine: drain its node first (its replicas move off, then DRAINED; a DOWN node is not waited
    for), then the join service revokes every credential it was issued or made, peer-removes its NATS servers
    and waits for every stream to be back at its copies on the others, and deletes its node record."""
    drained = await _drain(ctx, request.node_id, request.drain_timeout)
    reply = await _ask_join(ctx, {"node_id": request.node_id, "force": request.force}, request.timeout)
    revoked = reply.get("revoked")
    return NodeRemoved(
        request.node_id,
        [str(r) for r in revoked] if isinstance(revoked, list) else [],
        bool(reply.get("peer_removed")),
        [str(s) for s in reply.get("servers") or []],
        _short(reply),
        drained,
    )


async def retire_seats(ctx: ActionContext, request: RetireSeats) -> SeatsRetired:
    """Retire the first machine's two extra JetStream seats once three server machines hold every stream: the
    first machine's join service peer-removes them and records them, and its ``zattera up`` stops them."""
    reply = await _ask_join(ctx, {"seats": True}, request.timeout)
    return SeatsRetired(str(reply.get("node_id") or ""), [str(s) for s in reply.get("retired") or []], _short(reply))


def _short(reply: dict[str, Any]) -> list[StreamShort]:
    found = reply.get("short")
    return [
        StreamShort(str(s["stream"]), int(s["replicas"]), int(s["current"]), [str(n) for n in s["servers"]])
        for s in (found if isinstance(found, list) else [])
    ]


async def _ask_join(ctx: ActionContext, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The join service's answer, asked again (same request id) while none came: it runs the removal once."""
    from nats.errors import NoRespondersError

    # the security modules' imports, only when used
    from shared.security.permissions import JOIN_REMOVE_SUBJECT
    from shared.security.removal_answers import ask_removal

    try:
        data = await ask_removal(ctx.conn.nc, JOIN_REMOVE_SUBJECT, request, timeout)
    except NoRespondersError:
        raise Unavailable("no join service answered (none is running)") from None
    except TimeoutError:
        raise Unavailable(f"no join service answered within {timeout:.0f} s") from None
    reply: dict[str, Any] = json.loads(data or b"{}")
    if "error" in reply:
        raise Conflicting(str(reply["error"]))
    return reply


async def _drain(ctx: ActionContext, node_id: str, timeout: float) -> bool:
    """Drain the node (when it is registered, and not DRAINED or DOWN) and wait until it is DRAINED; the view
    must follow the state (``control(follow=True)``)."""
    node = ctx.view.node(node_id)
    if node is None or node.status in (pb.NODE_STATUS_DRAINED, pb.NODE_STATUS_DOWN):
        return False
    if node.status != pb.NODE_STATUS_DRAINING:
        await edit_node(ctx, EditNode(node_id, NodeChange.DRAIN))
    deadline = ctx.clock.now() + timeout
    while True:
        node = ctx.view.node(node_id)
        if node is None or node.status in (pb.NODE_STATUS_DRAINED, pb.NODE_STATUS_DOWN):
            return True
        if ctx.clock.now() > deadline:
            running = sum(1 for a in ctx.view.assignments_by_node(node_id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN)
            raise Conflicting(
                f"node {node_id} is not drained after {timeout:.0f} s ({running} replica(s) still placed there): "
                "nothing removed; see zattera nodes list, then run the command again"
            )
        await ctx.clock.sleep(0.25)
