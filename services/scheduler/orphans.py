"""Orphan reaping: assignments whose env or release no longer exists.

The API never deletes assignments: deleting an env (or its app or project) leaves them to the scheduler,
which flips the RUN ones to STOP and deletes them once stopped (two passes at least). A STOP orphan
that no agent will ever report STOPPED is reaped too.
"""

from __future__ import annotations

from services.scheduler.decisions import MAX_TXN_WRITES
from shared import keys as K
from shared.decision import Decision
from shared.placement.replicas import RUN, stop_is_reapable, stopped
from shared.state.reader import StateReader


def evaluate_orphans(view: StateReader, now: float) -> list[Decision]:
    """Stops and deletes of orphans, in id order, in writes of at most :data:`MAX_TXN_WRITES`."""
    result: list[Decision] = []
    current = Decision("orphans")
    for a in view.assignments():
        orphan = view.env(a.environment_id) is None or (bool(a.release_id) and view.release(a.release_id) is None)
        if not orphan:
            continue
        if a.desired == RUN:
            current.puts.append(stopped(a, now=now))
        elif stop_is_reapable(view, a, now):
            current.deletes.append(K.assignment(a.node_id, a.meta.id))
        else:
            continue
        if len(current) >= MAX_TXN_WRITES:
            result.append(current)
            current = Decision("orphans")
    if current:
        result.append(current)
    return result
