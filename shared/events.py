"""Platform events: ``zattera.v1.Event`` published on ``zattera.events.<kind>`` (stream ZATTERA_EVENTS).

Events are a log for operators, not state: publishing one never blocks or fails a transition.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from nats.errors import Error as NatsError
from zattera.v1 import types_pb2 as pb

from shared.clock import Clock, RealClock
from shared.ids import new_id
from shared.natsio import EVENTS_SUBJECT_PREFIX, Connection
from shared.telemetry import inject

log = logging.getLogger(__name__)

INFO = "info"
WARNING = "warning"
ERROR = "error"


def make_event(
    kind: str,
    message: str,
    *,
    clock: Clock | None = None,
    severity: str = INFO,
    project_id: str = "",
    app_id: str = "",
    environment_id: str = "",
    node_id: str = "",
    fields: Mapping[str, str] | None = None,
) -> pb.Event:
    event = pb.Event(
        kind=kind,
        severity=severity,
        message=message,
        project_id=project_id,
        app_id=app_id,
        environment_id=environment_id,
        node_id=node_id,
    )
    event.meta.id = new_id()
    event.meta.created_at.FromNanoseconds(int((clock or RealClock()).now() * 1e9))
    if fields:
        event.fields.update(fields)
    return event


def event_for_env(env: pb.Environment, kind: str, message: str, **kw: object) -> pb.Event:
    return make_event(kind, message, project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id, **kw)  # type: ignore[arg-type]


class EventPublisher:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def publish(self, *events: pb.Event) -> None:
        for event in events:
            subject = EVENTS_SUBJECT_PREFIX + event.kind
            try:
                await self._conn.js.publish(
                    subject, event.SerializeToString(deterministic=True), headers=inject(), timeout=2.0
                )
            except (NatsError, TimeoutError) as exc:
                log.warning("event %s not published: %s", event.kind, exc)
