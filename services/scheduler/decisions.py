"""What the scheduler's pure ``evaluate`` functions share: their events, and the in-memory memory of a term.

They return :class:`~shared.decision.Decision` values (one atomic transaction and the events to publish
once it has landed), committed by ``LeaderLoop.commit_decisions``. :class:`Notices` remembers the last
message of a recurring condition (``schedule.no_capacity``, ``volume.no_capacity``) so its event is
published when the condition starts or changes, not on every pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from zattera.v1 import types_pb2 as pb

from shared.clock import stamp
from shared.events import make_event
from shared.state.reader import StateReader

log = logging.getLogger(__name__)

MAX_TXN_WRITES = 500
"""Split point for cluster-wide decisions (orphans): an atomic batch holds at most 1,000 messages."""


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
