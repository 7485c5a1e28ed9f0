"""An operator's change to a node — cordon, uncordon, drain, label — and what it does to the node record.

Pure: the caller reads the node from the view, writes the returned record with one fenced write (expecting
the revision it read) and decides again when a concurrent write wins. The scheduler acts on the result: it
places nothing on an unschedulable node, and moves every replica off a DRAINING one, then marks it DRAINED.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from zattera.v1 import types_pb2 as pb

from shared.errors import ZatteraError


class NodeChange(StrEnum):
    CORDON = "cordon"
    """No new replicas (running ones stay)."""
    UNCORDON = "uncordon"
    """Schedulable again, and ALIVE (ends a drain)."""
    DRAIN = "drain"
    """No new replicas, and the running ones move off (DRAINING, then DRAINED)."""
    LABEL = "label"
    """Set or remove labels (placement constraints, region spread)."""


class NodeChangeRefused(ZatteraError):
    """The change cannot apply to the node as it is now."""


def change_node(node: pb.Node, change: NodeChange, labels: Mapping[str, str] | None = None) -> pb.Node | None:
    """The node record after ``change``: a copy (the view's message is never mutated), or None when there is
    nothing to write — cordoning a node that is DRAINING or DRAINED, which takes no replicas already.
    ``labels`` (LABEL only): key → value; an empty value removes the key. A DOWN node is refused an uncordon:
    it becomes schedulable again by heartbeating, not by an operator's word."""
    if change is NodeChange.CORDON and node.status in (pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED):
        return None
    if change is NodeChange.UNCORDON and node.status == pb.NODE_STATUS_DOWN:
        raise NodeChangeRefused(f"node {node.meta.id} is down: it cannot be uncordoned until it heartbeats again")
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
