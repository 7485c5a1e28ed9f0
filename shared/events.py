"""Platform events: ``zattera.v1.Event`` published on ``zattera.events.<kind>`` (stream ZATTERA_EVENTS).

Events are a log for operators, not state: they are published only after the transition they announce
has been committed, and a failed publish is logged, never raised. An event that names its transition
(``Event.transition``, e.g. ``env.E@42:scaled``: the key, the revision the decision read, what changed)
carries it as ``Nats-Msg-Id``, so the stream stores a transition once even when it is published again
(a retried publish whose first ack was lost); the catalogue of kinds is in docs/observability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Protocol

from google.protobuf.message import DecodeError
from nats.errors import Error as NatsError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.clock import Clock, RealClock, stamp
from shared.connection import Connection
from shared.ids import new_id
from shared.state.feed import key_matches
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX
from shared.telemetry import inject

log = logging.getLogger(__name__)

INFO = "info"
WARNING = "warning"
ERROR = "error"

MSG_ID_HEADER = "Nats-Msg-Id"
PUBLISH_TIMEOUT = 2.0


def make_event(
    kind: str,
    message: str,
    *,
    clock: Clock | None = None,
    at: float | None = None,
    severity: str = INFO,
    project_id: str = "",
    app_id: str = "",
    environment_id: str = "",
    node_id: str = "",
    fields: Mapping[str, str] | None = None,
    transition: str = "",
) -> pb.Event:
    event = pb.Event(
        transition=transition,
        kind=kind,
        severity=severity,
        message=message,
        project_id=project_id,
        app_id=app_id,
        environment_id=environment_id,
        node_id=node_id,
    )
    event.meta.id = new_id()
    when = at if at is not None else (clock or RealClock()).now()
    stamp(event.meta.created_at, when)
    if fields:
        event.fields.update(fields)
    return event


class OfEnv(Protocol):
    """A record of one environment (a volume, a log drain): it names its project and environment."""

    @property
    def project_id(self) -> str: ...

    @property
    def environment_id(self) -> str: ...


def env_event(
    kind: str, message: str, record: OfEnv, *, clock: Clock, severity: str = INFO, fields: Mapping[str, str]
) -> pb.Event:
    """An event about ``record``: it carries the record's project and environment."""
    return make_event(
        kind,
        message,
        clock=clock,
        severity=severity,
        project_id=record.project_id,
        environment_id=record.environment_id,
        fields=fields,
    )


def transition_id(key: str, revision: int, what: str) -> str:
    """The dedup id of the transition of ``key`` decided at ``revision``: ``<key>@<revision>:<what>``."""
    return f"{key}@{revision}:{what}"


def node_status_name(status: int) -> str:
    return pb.NodeStatus.Name(status).removeprefix("NODE_STATUS_")  # type: ignore[arg-type]


_NODE_STATUS_KINDS = {
    pb.NODE_STATUS_ALIVE: ("node.up", INFO),
    pb.NODE_STATUS_SUSPECT: ("node.suspect", WARNING),
    pb.NODE_STATUS_DOWN: ("node.down", WARNING),
    pb.NODE_STATUS_DRAINING: ("node.draining", INFO),
    pb.NODE_STATUS_DRAINED: ("node.drained", INFO),
}


def node_change_event(
    before: pb.Node, after: pb.Node, now: float, *, actor: str, revision: int, message: str = ""
) -> pb.Event | None:
    """The event for a node's status or schedulability change (None when neither changed).

    A cordon or uncordon is named as such even when the status moves with it (uncordoning a DRAINED
    node makes it ALIVE); ``revision`` is the node's revision the change was decided on."""
    was, now_status = node_status_name(before.status), node_status_name(after.status)
    if after.status != before.status and after.status == pb.NODE_STATUS_DRAINING:
        kind, severity = _NODE_STATUS_KINDS[pb.NODE_STATUS_DRAINING]
    elif after.schedulable != before.schedulable:
        kind, severity = ("node.uncordoned" if after.schedulable else "node.cordoned"), INFO
    elif after.status != before.status and after.status in _NODE_STATUS_KINDS:
        kind, severity = _NODE_STATUS_KINDS[after.status]
    else:
        return None
    node_id = after.meta.id
    return make_event(
        kind,
        message or f"node {after.name or node_id}: {kind.removeprefix('node.')} ({was} -> {now_status})",
        at=now,
        severity=severity,
        node_id=node_id,
        fields={"actor": actor, "from": was, "to": now_status, "schedulable": str(after.schedulable).lower()},
        transition=transition_id(K.node(node_id), revision, kind),
    )


SCALE_KINDS = (
    "autoscale.scaled",
    "serverless.scaled",
    "scale.changed",
    "env.scaled",
    "scaletozero.cooled",
    "scaletozero.woken",
)
"""The kinds of the events that change an env's replica count (autoscaling, scale to zero, by hand)."""

KINDS = (
    "backup.created",
    "backup.failed",
    "backup.restored",
    "deploy.promoted",
    "deploy.rolled_back",
    "deploy.succeeded",
    "deploy.failed",
    "deploy.canceled",
    "deploy.superseded",
    "deploy.maintenance_start",
    "deploy.maintenance_end",
    *SCALE_KINDS,
    "node.up",
    "node.down",
    "node.suspect",
    "node.cordoned",
    "node.uncordoned",
    "node.draining",
    "node.drained",
    "node.drain.stateful_stopped",
    "schedule.no_capacity",
    "schedule.replica_failed",
    "volume.no_capacity",
    "volume.node_lost",
    "volume.recovered",
    "volume.restore_failed",
    "volume.offsite_copied",
    "volume.offsite_failed",
    "volume.offsite_pruned",
    "volume.offsite_prune_failed",
    "build.waiting_for_builder",
    "certificate.issued",
    "certificate.renewed",
    "certificate.failed",
    "job.created",
    "job.started",
    "job.succeeded",
    "job.failed",
    "job.retrying",
    "job.canceled",
    "job.missed",
    "job.skipped",
    "secrets.refused",
    "env.deleted",
    "app.deleted",
    "project.deleted",
    "cluster.upgraded",
    "notify.test",
    "notify.failing",
    "notify.recovered",
    "drain.failing",
    "drain.recovered",
    "git.deploy",
    "git.failed",
    "preview.created",
    "preview.deleted",
    "addon.created",
    "addon.attached",
    "addon.detached",
    "addon.restored",
    "addon.deleted",
    "deployment.canary_step",
    "deployment.canary_aborted",
)
"""Every event kind the platform emits (docs/observability.md has the catalogue; each kind is documented)."""


def kind_subject(kind: str) -> str:
    """The subject filter of ``zattera events --kind``: ``deploy`` → every ``deploy.*`` kind
    (``zattera.events.deploy.>``); ``deploy.failed`` exactly; NATS wildcards pass through; empty → all."""
    kind = kind.strip()
    if not kind:
        return EVENTS_SUBJECT_PREFIX + ">"
    if "." not in kind and kind not in ("*", ">"):
        return f"{EVENTS_SUBJECT_PREFIX}{kind}.>"
    return EVENTS_SUBJECT_PREFIX + kind


def kind_problem(kind: str, seen: Iterable[str] = ()) -> str | None:
    """Why ``--kind`` matches no event kind (None when it matches one of :data:`KINDS` or of ``seen``, the
    kinds stored in the stream): a typo would otherwise list nothing and look like a quiet platform."""
    if not kind.strip():
        return None
    subject = kind_subject(kind)
    known = sorted({*KINDS, *seen})
    if any(key_matches(subject, EVENTS_SUBJECT_PREFIX + known_kind) for known_kind in known):
        return None
    families = sorted({k.split(".")[0] for k in known})
    return (
        f"--kind {kind!r}: no such event kind. Families: {', '.join(families)}; kinds: {', '.join(known)} "
        "(docs/observability.md)"
    )


ENV_DELETED = "env.deleted"
PATH_FIELD = "env"
"""Field of ``env.deleted``: the deleted env's ``project/app/env`` (its name outlives the env's record)."""
_DELETED_MESSAGE = re.compile(r"^environment (\S+) deleted")


async def deleted_env_paths(conn: Connection, timeout: float = 5.0) -> dict[str, str]:
    """env id → ``project/app/env`` of each deleted env whose ``env.deleted`` event the stream still holds
    (an event older than the path field gives the env's name alone), so that events of a deleted env can
    still name it. One watch over the ``env.deleted`` subject; nothing when there is none."""
    from shared.watches import WatchSpec, follow

    subject = EVENTS_SUBJECT_PREFIX + ENV_DELETED
    info = await conn.js.stream_info(EVENTS_STREAM, subjects_filter=subject)
    if not (info.state.subjects or {}).get(subject):
        return {}
    watch = await follow(conn, WatchSpec(EVENTS_STREAM, (subject,), "all"))
    found: dict[str, str] = {}
    try:
        while (msg := await watch.next_stored(timeout)) is not None:
            with contextlib.suppress(DecodeError):
                event = pb.Event.FromString(msg.data)
                named = _DELETED_MESSAGE.match(event.message)
                path = event.fields.get(PATH_FIELD) or (named.group(1) if named else "")
                if event.environment_id and path:
                    found[event.environment_id] = path
    finally:
        await watch.unsubscribe()
    return found


EVENT_SCALED = "scale.changed"
EVENT_COOLED = "scaletozero.cooled"
EVENT_WOKEN = "scaletozero.woken"


def replica_count(n: int) -> str:
    """``1 replica``, ``3 replicas``: how event messages count replicas."""
    return "1 replica" if n == 1 else f"{n} replicas"


def scale_event(
    env: pb.Environment, revision: int, current: int, target: int, *, kind: str, actor: str, message: str, now: float
) -> pb.Event:
    """The event of a committed replica-count change of ``env`` (decided at ``revision``): who decided and
    from → to. Going to 0 is a cool and leaving 0 a wake, whoever decided; ``kind`` names any other change."""
    if target == 0:
        kind = EVENT_COOLED
    elif current == 0:
        kind = EVENT_WOKEN
    return event_for_env(
        env,
        kind,
        message,
        at=now,
        fields={"actor": actor, "from": str(current), "to": str(target)},
        transition=transition_id(K.env(env.meta.id), revision, kind),
    )


def event_for_env(env: pb.Environment, kind: str, message: str, **kw: object) -> pb.Event:
    return make_event(kind, message, project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id, **kw)  # type: ignore[arg-type]


class EventPublisher:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def publish(self, *events: pb.Event) -> None:
        """Publish after the commit; failures are logged, never raised. The events go out together (sent
        in order on the connection, acknowledged concurrently), so a pass that announces many changes
        waits for one round trip — at most two timeouts when JetStream does not answer — not one each."""
        await asyncio.gather(*(self._publish_one(event) for event in events))

    async def _publish_one(self, event: pb.Event) -> None:
        """One event; with a transition id it is retried once after a timeout (the stream drops the copy
        if the first attempt landed after all)."""
        subject = EVENTS_SUBJECT_PREFIX + event.kind
        headers = inject()
        if event.transition:
            headers[MSG_ID_HEADER] = event.transition
        data = event.SerializeToString(deterministic=True)
        attempts = 2 if event.transition else 1
        for attempt in range(1, attempts + 1):
            try:
                await self._conn.js.publish(subject, data, headers=headers, timeout=PUBLISH_TIMEOUT)
                return
            except (NatsError, TimeoutError) as exc:
                if attempt == attempts or not isinstance(exc, TimeoutError):
                    log.warning("event %s not published: %s", event.kind, exc)
                    return
