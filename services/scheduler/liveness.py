"""Node liveness (leader-gated by ``lease.liveness``): ALIVE ⇄ DOWN from the agents' heartbeats.

Agents heartbeat into ``zattera-live`` (every 5 s). An ALIVE node whose
latest heartbeat is older than 30 s becomes DOWN (event ``node.down``); a DOWN node that heartbeats
again becomes ALIVE (``node.up``). DRAINING and DRAINED belong to the operator and are never touched.
For 45 s after a term starts nothing is marked DOWN: a new leader first gives every agent time to be
heard (its live view may have just started). A node never heard of counts as seen at the term start. Both
count from when the process's live view started instead when that was earlier: a leader whose term was
interrupted (its lease lost while the state stream elected a leader after a machine loss) and taken again has
been hearing the heartbeats all along, and a node lost with that machine is marked DOWN 30 s after its last
heartbeat, not 45 s after the new term (issue 34: a machine loss took 55 s to be noticed).
Both windows are settings (``ZATTERA_NODE_HEARTBEAT_DEADLINE``, ``ZATTERA_LIVENESS_GRACE``) so tests and
demos can shorten them; the tick is the shorter of 5 s and ``ZATTERA_LOOP_TICK``.
"""

from __future__ import annotations

from collections.abc import Callable

from zattera.v1 import types_pb2 as pb

from services.scheduler.settings import DEFAULTS
from shared import keys as K
from shared.clock import from_timestamp, stamp
from shared.decision import Decision
from shared.events import node_change_event
from shared.live import LiveView
from shared.loop import LeaderLoop, LoopDeps
from shared.state.reader import StateReader

TICK = 5.0
ACTOR = "system:liveness"


def evaluate_liveness(
    view: StateReader,
    seen_at: Callable[[str], float | None],
    now: float,
    term_started: float,
    *,
    deadline: float = DEFAULTS.node_heartbeat_deadline,
    grace: float = DEFAULTS.liveness_grace,
) -> list[Decision]:
    """Status flips (one write per node) from each node's last heartbeat time."""
    result = []
    grace_over = now - term_started >= grace
    for node in view.nodes():
        node_id = node.meta.id
        heard = seen_at(node_id)
        stored = from_timestamp(node.last_heartbeat_at) if node.HasField("last_heartbeat_at") else 0.0
        last = max(heard or 0.0, stored, term_started)
        if node.status == pb.NODE_STATUS_ALIVE and grace_over and now - last > deadline:
            status = pb.NODE_STATUS_DOWN
            message = f"node {node_id} missed heartbeats for {now - last:.0f}s; marked DOWN"
        elif node.status == pb.NODE_STATUS_DOWN and heard is not None and now - heard <= deadline:
            status = pb.NODE_STATUS_ALIVE
            message = f"node {node_id} is heartbeating again; marked ALIVE"
        else:
            continue
        changed = pb.Node()
        changed.CopyFrom(node)
        changed.status = status
        if heard is not None:
            stamp(changed.last_heartbeat_at, heard)
        ev = node_change_event(node, changed, now, actor=ACTOR, revision=view.rev(K.node(node_id)), message=message)
        result.append(Decision(f"liveness:{node_id}", puts=[changed], events=[ev] if ev else []))
    return result


class Liveness(LeaderLoop):
    name = "liveness"
    kinds = frozenset({K.NODE})

    def __init__(
        self,
        deps: LoopDeps,
        *,
        live: LiveView,
        tick: float = TICK,
        deadline: float = DEFAULTS.node_heartbeat_deadline,
        grace: float = DEFAULTS.liveness_grace,
    ) -> None:
        super().__init__(deps, tick=tick)
        self.live = live
        self.deadline = deadline
        self.grace = grace
        self.term_started = self.clock.now()

    def on_term_start(self) -> None:
        self.term_started = self.clock.now()

    async def run_pass(self) -> None:
        assert self.writer is not None, "a pass needs a writer (set by run(), or by the test)"
        heard_since = self.term_started
        if self.live.started_at is not None:
            heard_since = min(heard_since, self.live.started_at)
        writes = evaluate_liveness(
            self.view,
            self.live.node_seen_at,
            self.clock.now(),
            heard_since,
            deadline=self.deadline,
            grace=self.grace,
        )
        await self.commit_decisions(writes)
