"""What ``zattera drains list``, ``zattera status`` and the console say about log drains (docs/logs.md
"Drains"); light to import (no wire formats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.names import env_label
from shared.clock import from_timestamp
from shared.state.reader import StateReader


@dataclass(frozen=True)
class Drain:
    name: str
    url: str
    """Scheme, host and port only."""
    scope: str
    """``env project/app/env`` or ``project P``."""
    events: bool
    delivered_lines: int = 0
    last_delivered_at: float = 0.0
    lag_messages: int = 0
    dropped_messages: int = 0
    dropped_lines: int = 0
    cursors: dict[str, int] = field(default_factory=dict)
    """Stream → the last sequence delivered."""
    failing: bool = False
    failing_since: float = 0.0
    failures: int = 0
    last_error: str = ""


def describe(view_drain: pb.LogDrain, status: pb.LogDrainStatus | None, scope: str) -> Drain:
    s = status or pb.LogDrainStatus()
    return Drain(
        name=view_drain.meta.id,
        url=view_drain.url_shown,
        scope=scope,
        events=view_drain.events,
        delivered_lines=s.delivered_lines,
        last_delivered_at=from_timestamp(s.last_delivered_at),
        lag_messages=s.lag_messages,
        dropped_messages=s.dropped_messages,
        dropped_lines=s.dropped_lines,
        cursors={src.stream: src.delivered_seq for src in s.sources},
        failing=s.failing,
        failing_since=from_timestamp(s.failing_since),
        failures=s.failures,
        last_error=s.last_error,
    )


def scope_of(view: StateReader, record: pb.LogDrain) -> str:
    """``env project/app/env`` or ``project P``."""
    if record.environment_id:
        return f"env {env_label(view, record.environment_id)}"
    project = view.project(record.project_id)
    return f"project {project.name if project else record.project_id}"


def status_lines(view: StateReader) -> list[tuple[str, bool]]:
    """What ``zattera status`` says about each drain: one line, and whether it is bad news (FAILING, or lines
    dropped by retention)."""
    lines = []
    for record in sorted(view.all(K.LOG_DRAIN), key=lambda r: r.meta.id):
        assert isinstance(record, pb.LogDrain)
        status = view.get(K.LOG_DRAIN_STATUS, record.meta.id)
        d = describe(record, status if isinstance(status, pb.LogDrainStatus) else None, scope_of(view, record))
        if d.failing:
            state = f"FAILING ({d.failures} attempt(s) in a row): {d.last_error}"
        elif d.failures:
            state = f"retrying: {d.last_error}"
        else:
            state = "ok"
        dropped = f", {d.dropped_messages} message(s) (~{d.dropped_lines} lines) dropped by retention"
        text = (
            f"drains: {d.name} ({d.scope} → {d.url}) {state}; {d.delivered_lines} lines delivered, "
            f"lag {d.lag_messages} message(s){dropped if d.dropped_messages else ''}"
        )
        lines.append((text, d.failing or d.dropped_messages > 0))
    return lines
