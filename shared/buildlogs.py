"""The build wire contract between the dispatcher and builders, and reading a build's log.

Dispatch:

* The dispatcher requests ``zattera.agent.<node_id>.build`` with a serialized ``RunBuildRequest``. The
  builder answers at once: an empty reply accepts the build; a reply carrying the header
  ``Zattera-Error`` refuses it (the build fails with ``build stream: <text>``).
* The builder then publishes ``BuildEvent``\\ s on ``zattera.builds.<build_id>.events`` (stream
  ``ZATTERA_BUILD_EVENTS``), with :class:`BuildEventPublisher`. The last event has ``done`` set (the
  end of the build's events). Events are durable so a new dispatcher leader replays what
  it missed during a failover.
* Cancel: the dispatcher requests ``zattera.agent.<node_id>.build.cancel`` with a ``CancelBuildRequest``;
  the builder stops the build and may answer a ``CancelBuildResponse``.

Logs: the dispatcher copies every log line of the events into stream ``ZATTERA_BUILD_LOGS``, subject
``zattera.builds.<build_id>.log``, one line per message, each tagged with the events-stream sequence it
came from (so a new leader resumes copying without duplicates). When the build ends the dispatcher
appends an end marker (an empty message with header ``Zattera-Build-End: <status>``). The cap per build
(default 10,000 lines) counts log lines only: the stream's ``max_msgs_per_subject`` is the cap plus the
marker's slot, so an ended build keeps exactly its newest ``cap`` lines and the marker; while a build
runs, that slot may hold one older line, which readers leave out. :func:`read_build_log` and
:func:`follow_build_log` read the log from any process, whichever dispatcher wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import deque
from collections.abc import AsyncIterator, Sequence

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError, NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.backoff import Backoff
from shared.connection import Connection
from shared.jetstream import read_state_key
from shared.streams import BUILD_LOG_END_SLOTS
from shared.subjects import BUILD_LOGS_STREAM, agent_subject, build_events_subject, build_log_subject
from shared.watches import WatchSpec
from shared.watches import follow as follow_watch

ERROR_HEADER = "Zattera-Error"
EVENT_SEQ_HEADER = "Zattera-Event-Seq"
END_HEADER = "Zattera-Build-End"

TERMINAL_STATUSES: frozenset[int] = frozenset(
    {pb.BUILD_STATUS_SUCCEEDED, pb.BUILD_STATUS_FAILED, pb.BUILD_STATUS_CANCELED}
)


def run_build_subject(node_id: str) -> str:
    return agent_subject(node_id, "build")


def cancel_build_subject(node_id: str) -> str:
    return agent_subject(node_id, "build.cancel")


def build_id_of_events_subject(subject: str) -> str:
    """``zattera.builds.<id>.events.<node>`` → ``<id>``."""
    return subject.split(".")[2]


def sender_of_events_subject(subject: str) -> str:
    """``zattera.builds.<id>.events.<node>`` → ``<node>``: the builder that sent it (permission-enforced)."""
    parts = subject.split(".")
    return parts[4] if len(parts) == 5 else ""


PUBLISH_RETRY_WINDOW = 30.0
"""How long a builder keeps publishing one event while the build-events stream elects a leader."""


class BuildEventPublisher:
    """Builder side: publishes one build's events, numbered, durably (each publish is acknowledged)."""

    def __init__(self, conn: Connection, build_id: str, node_id: str) -> None:
        self._conn = conn
        self.build_id = build_id
        self.subject = build_events_subject(build_id, node_id)
        self._sequence = 0
        # The stream drops duplicates by message id across all subjects: an id nobody else can guess keeps
        # another builder from pre-empting (and so suppressing) this build's events.
        self._msg_id_prefix = f"{build_id}.{secrets.token_hex(8)}"

    async def publish(self, event: cpb.BuildEvent) -> None:
        """Publish the next event; retried for ``PUBLISH_RETRY_WINDOW`` while the stream cannot answer (its
        leader lost with a NATS server), under a message id so that a retry of a publish that did land is
        dropped by the stream's duplicate window."""
        self._sequence += 1
        event.build_id = self.build_id
        event.sequence = self._sequence
        data = event.SerializeToString(deterministic=True)
        headers = {"Nats-Msg-Id": f"{self._msg_id_prefix}.{self._sequence}"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_RETRY_WINDOW
        backoff = Backoff(0.25, 2.0)
        while True:
            try:
                await self._conn.js.publish(self.subject, data, timeout=5.0, headers=headers)
                return
            except (NatsTimeoutError, TimeoutError, NoStreamResponseError):
                delay = next(backoff)
                if loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)

    async def log(self, line: str) -> None:
        await self.publish(cpb.BuildEvent(log=pb.LogLine(line=line, stream="build")))

    async def succeeded(self, image_digest: str, platforms: Sequence[str] = ()) -> None:
        """The success event; the stream still needs :meth:`done` (success is decided at the end)."""
        await self.publish(
            cpb.BuildEvent(status=pb.BUILD_STATUS_SUCCEEDED, image_digest=image_digest, platforms=list(platforms))
        )

    async def failed(self, error: str) -> None:
        await self.publish(cpb.BuildEvent(status=pb.BUILD_STATUS_FAILED, error=error, done=True))

    async def done(self) -> None:
        await self.publish(cpb.BuildEvent(done=True))


# ---------------------------------------------------------------------------------------- writing the log


async def append_log_lines(conn: Connection, build_id: str, lines: Sequence[tuple[int, str]]) -> None:
    """Append (events-stream sequence, line) pairs to the build's log, in order."""
    subject = build_log_subject(build_id)
    for event_seq, line in lines:
        await conn.js.publish(
            subject, line.encode(), headers={EVENT_SEQ_HEADER: str(event_seq)}, stream=BUILD_LOGS_STREAM, timeout=5.0
        )


async def close_log(conn: Connection, build_id: str, status: int) -> None:
    """Mark the end of the build's log so followers stop."""
    await conn.js.publish(
        build_log_subject(build_id),
        b"",
        headers={END_HEADER: pb.BuildStatus.Name(status)},  # type: ignore[arg-type]
        stream=BUILD_LOGS_STREAM,
        timeout=5.0,
    )


async def last_copied_event_seq(conn: Connection, build_id: str) -> int:
    """Events-stream sequence of the last line already in the log (0 = none): where a new leader resumes."""
    try:
        msg = await conn.js.get_last_msg(BUILD_LOGS_STREAM, build_log_subject(build_id))
    except NotFoundError:
        return 0
    headers = msg.headers or {}
    return int(headers.get(EVENT_SEQ_HEADER, "0") or 0)


# ---------------------------------------------------------------------------------------- reading the log


async def _build_status(conn: Connection, build_id: str) -> int:
    last = await read_state_key(conn.js, K.build(build_id))
    if last.data is None:
        return pb.BUILD_STATUS_UNSPECIFIED
    return int(pb.Build.FromString(last.data).status)


async def read_build_log(conn: Connection, build_id: str) -> list[str]:
    """Every line of the build's log that the stream still holds (the oldest beyond the cap are gone)."""
    lines: list[str] = []
    async for line in _log_lines(conn, build_id, follow=False):
        lines.append(line)
    return lines


async def follow_build_log(conn: Connection, build_id: str, *, idle_check: float = 1.0) -> AsyncIterator[str]:
    """Yield the build's log lines, then new ones as they come, until the build ends.

    Ends at the dispatcher's end marker, or when the build record is terminal and no line came for
    ``idle_check`` seconds (a build canceled while queued has no dispatcher-written end).
    """
    async for line in _log_lines(conn, build_id, follow=True, idle_check=idle_check):
        yield line


async def lines_per_build(conn: Connection) -> int | None:
    """The build-log cap in lines: the stream's per-subject limit less the end marker's slot (None: no cap)."""
    info = await conn.js.stream_info(BUILD_LOGS_STREAM)
    per_subject = info.config.max_msgs_per_subject or -1
    return per_subject - BUILD_LOG_END_SLOTS if per_subject > BUILD_LOG_END_SLOTS else None


async def _log_lines(conn: Connection, build_id: str, *, follow: bool, idle_check: float = 1.0) -> AsyncIterator[str]:
    """The lines already stored (the backlog, up to the newest when this starts) come out at once, trimmed to
    the newest ``lines_per_build``; with ``follow``, later lines then come as they are stored."""
    subject = build_log_subject(build_id)
    try:
        last = await conn.js.get_last_msg(BUILD_LOGS_STREAM, subject)
        last_seq = int(last.seq or 0)
    except NotFoundError:
        last_seq = 0
    if not follow and last_seq == 0:
        return
    backlog: deque[str] = deque(maxlen=await lines_per_build(conn))
    in_backlog = last_seq > 0
    sub = await follow_watch(conn, WatchSpec(BUILD_LOGS_STREAM, (subject,)))
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_check)
            except (NatsTimeoutError, TimeoutError):
                while backlog:  # the backlog's last message vanished (purged): what was read is all there is
                    yield backlog.popleft()
                in_backlog = False
                if not follow:
                    return
                if await _build_status(conn, build_id) in TERMINAL_STATUSES:
                    return
                continue
            seq = msg.metadata.sequence.stream
            ended = END_HEADER in (msg.headers or {})
            if not ended:
                line = msg.data.decode(errors="replace")
                if in_backlog:
                    backlog.append(line)
                else:
                    yield line
            if in_backlog and (seq >= last_seq or (ended and follow)):
                in_backlog = False
                while backlog:
                    yield backlog.popleft()
            if ended and follow:
                return
            if not follow and seq >= last_seq:
                return
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(sub.unsubscribe())
