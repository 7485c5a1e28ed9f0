"""Committing what the scheduler's pure ``evaluate`` functions return, and the in-memory memory of a term.

They return :class:`~shared.decision.Decision` values (one atomic transaction and the events to publish
once it has landed). :class:`Notices` remembers the last message of a recurring condition so its event is
published when the condition starts or changes, not on every pass (the reference re-emitted
``schedule.no_capacity`` and ``volume.no_capacity`` each pass).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from zattera.v1 import types_pb2 as pb

from shared.clock import stamp
from shared.decision import Decision
from shared.events import EventPublisher, make_event
from shared.state.reader import StateReader
from shared.tasks import raise_if_cancelling
from shared.txn import Writer

log = logging.getLogger(__name__)

MAX_TXN_WRITES = 500
"""Split point for cluster-wide decisions (orphans): an atomic batch holds at most 1,000 messages."""


async def commit(writer: Writer, events: EventPublisher, writes: Sequence[Decision], *, loop: str) -> list[bool]:
    """Commit each non-empty :class:`Decision` atomically (packed into few batches) and publish the events of
    those that landed. One bool per input (an empty one counts as landed). A refused write is re-decided
    on the next pass, which the conflicting change triggers; :class:`shared.txn.Deposed` propagates."""
    pending = [(i, w) for i, w in enumerate(writes) if w]
    landed = [True] * len(writes)
    if not pending:
        return landed
    results = await writer.commit_many([w.txn(writer) for _, w in pending])
    for (i, w), error in zip(pending, results, strict=True):
        if error is not None:
            landed[i] = False
            log.info("%s: %s not written (%s); re-deciding on the next pass", loop, w.label, error)
        elif w.events:
            await events.publish(*w.events)
    raise_if_cancelling()
    return landed


def event(
    kind: str,
    message: str,
    now: float,
    *,
    severity: str,
    env: pb.Environment | None = None,
    project_id: str = "",
    environment_id: str = "",
    node_id: str = "",
) -> pb.Event:
    """An event stamped with the loop's clock, scoped to an env (its project and app) or a node."""
    if env is not None:
        project_id, environment_id = env.project_id, env.meta.id
    ev = make_event(
        kind,
        message,
        severity=severity,
        project_id=project_id,
        app_id=env.app_id if env is not None else "",
        environment_id=environment_id,
        node_id=node_id,
    )
    stamp(ev.meta.created_at, now)
    return ev


def volume_event(
    view: StateReader, volume: pb.Volume, kind: str, message: str, now: float, *, severity: str, node_id: str = ""
) -> pb.Event:
    """An event about ``volume``, scoped to its env (or its project when the env is gone)."""
    return event(
        kind,
        message,
        now,
        severity=severity,
        env=view.env(volume.environment_id),
        project_id=volume.project_id,
        environment_id=volume.environment_id,
        node_id=node_id,
    )


class Notices:
    """The last condition published per (env, topic): an env's shortfall, a volume's missing home."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], str] = {}

    def due(self, env_id: str, topic: str, condition: str | None) -> bool:
        """Record the current condition (None = cleared); True when it started or changed."""
        subject = (env_id, topic)
        if condition is None:
            self._last.pop(subject, None)
            return False
        if self._last.get(subject) == condition:
            return False
        self._last[subject] = condition
        return True

    def retain(self, env_ids: Iterable[str]) -> None:
        """Forget the conditions of envs that no longer exist."""
        keep = set(env_ids)
        self._last = {s: m for s, m in self._last.items() if s[0] in keep}
