"""Node drain (the last step of a pass): empty a DRAINING node, then mark it DRAINED.

On a draining node: stopped assignments are deleted; a stateful (or release-less) RUN replica is stopped
at once, since its pinned data cannot move (event ``node.drain.stateful_stopped``); a stateless one is
stopped only when enough replicas of its release run elsewhere (placement put replacements there earlier
in the same pass), so draining is zero-downtime. When nothing is left running or stopping, the node
becomes DRAINED (``schedulable`` stays false).

Replacements only count on ALIVE nodes: two nodes draining together never count each other's replicas.
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from services.scheduler.decisions import event
from shared import keys as K
from shared.decision import Decision
from shared.events import WARNING, node_change_event
from shared.placement.replicas import RUN, STOP, desired_replicas, stop_is_reapable, stopped
from shared.state.reader import StateReader

ACTOR = "system:drain"
_SERVING = (pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY)


def replacement_ready(view: StateReader, a: pb.Assignment) -> bool:
    """True when the env no longer needs ``a``: enough same-release replicas serve on other ALIVE nodes."""
    env = view.env(a.environment_id)
    if env is None:
        return True
    want = desired_replicas(env)
    if want == 0:
        return True
    serving = 0
    for other in view.assignments(a.environment_id):
        if (
            other.release_id == a.release_id
            and other.node_id != a.node_id
            and other.desired == RUN
            and other.observed.state in _SERVING
        ):
            node = view.node(other.node_id)
            serving += node is not None and node.status == pb.NODE_STATUS_ALIVE
    return serving >= want


def evaluate_drains(view: StateReader, now: float) -> list[Decision]:
    """One write per draining node: its stops and deletes, and DRAINED once it is empty."""
    result = []
    for node in view.nodes():
        if node.status != pb.NODE_STATUS_DRAINING:
            continue
        writes = Decision(f"drain:{node.meta.id}")
        occupied = 0
        stateful_stopped = 0
        for a in view.assignments_by_node(node.meta.id):
            if a.desired == STOP:
                if stop_is_reapable(view, a, now):
                    writes.deletes.append(K.assignment(a.node_id, a.meta.id))
                else:
                    occupied += 1
            elif a.desired == RUN:
                occupied += 1
                release = view.release(a.release_id)
                if release is None or release.service.stateful:
                    writes.puts.append(stopped(a, now=now))
                    stateful_stopped += 1
                elif replacement_ready(view, a):
                    writes.puts.append(stopped(a, now=now))
        if stateful_stopped:
            message = f"stopped {stateful_stopped} stateful service(s) on the draining node (volumes are pinned here)"
            writes.events.append(
                event("node.drain.stateful_stopped", message, now, severity=WARNING, node_id=node.meta.id)
            )
        if occupied == 0:
            drained = pb.Node()
            drained.CopyFrom(node)
            drained.status = pb.NODE_STATUS_DRAINED
            writes.puts.append(drained)
            change = node_change_event(node, drained, now, actor=ACTOR, revision=view.rev(K.node(node.meta.id)))
            writes.events.extend([change] if change else [])
        if writes:
            result.append(writes)
    return result
