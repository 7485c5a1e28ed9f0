"""Where a log drain stands in each stream it reads: its durable consumer bound again from the drain's
cursor, the cursors and lag written into the drain's status, and the messages retention removed before
delivery counted as dropped.

Each stream of a drain holds nothing but what the drain reads, so a jump in the stream sequences delivered
(or a stream whose first sequence passed the drain's cursor) is messages that retention removed.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import drains

log = logging.getLogger(__name__)


@dataclass
class Source:
    """One stream a drain reads, and where the drain stands in it."""

    stream: str
    subject: str
    env_id: str
    """"" for the events stream."""
    sub: JetStreamContext.PullSubscription | None = None
    cursor: int = 0
    """The last stream sequence delivered (or dropped); 0 = not known yet (the first message sets it)."""
    last_seq: int = 0
    dropped: int = 0
    messages: int = 0
    lines: int = 0
    """Messages and lines delivered by this task: the mean estimates the lines of dropped messages."""


async def bind_source(
    js: JetStreamContext,
    drain: pb.LogDrain,
    src: Source,
    status: pb.LogDrainStatus,
    *,
    ack_wait: float,
    max_ack_pending: int,
) -> None:
    """Bind ``src`` to the drain's durable consumer on its stream, made again from the drain's cursor (the
    greater of the status's and the consumer's ack floor) so that messages a former task held unacked
    come again at once and in order (not after the ack wait); the first time, from the drain's start."""
    durable = drains.consumer_name(drain.meta.id)
    known = next((s for s in status.sources if s.stream == src.stream), None)
    cursor = known.delivered_seq if known else 0
    try:
        info = await js.consumer_info(src.stream, durable)
    except NotFoundError:
        info = None
    if info is not None and info.ack_floor is not None:
        cursor = max(cursor, info.ack_floor.stream_seq)
    if info is None or cursor:
        if info is not None:
            await js.delete_consumer(src.stream, durable)
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=src.subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_ack_pending=max_ack_pending,
            inactive_threshold=30 * 86400.0,
        )
        if cursor:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = cursor + 1
        else:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.datetime.fromtimestamp(drain.start_at.ToNanoseconds() / 1e9, datetime.UTC)
        await js.add_consumer(src.stream, config)
    src.cursor = cursor
    src.dropped = known.dropped_messages if known else 0
    src.sub = await js.pull_subscribe_bind(durable=durable, stream=src.stream)


async def any_made(js: JetStreamContext, missing: Iterable[Source]) -> bool:
    """Whether any of the streams not found before exists now."""
    for src in missing:
        try:
            await js.stream_info(src.stream)
        except NotFoundError:
            continue
        return True
    return False


def count_dropped(src: Source, status: pb.LogDrainStatus, dropped: int) -> None:
    """``dropped`` messages of ``src`` were removed by retention before delivery."""
    src.dropped += dropped
    status.dropped_messages += dropped
    per_message = max(1, round(src.lines / src.messages)) if src.env_id and src.messages else 1
    status.dropped_lines += dropped * per_message
    log.warning("drains: drain %s: %d message(s) of %s dropped by retention", status.meta.id, dropped, src.stream)


def write_source(src: Source, status: pb.LogDrainStatus) -> None:
    """``src``'s cursor, dropped messages and last sequence into ``status``, and the drain's lag."""
    record = next((s for s in status.sources if s.stream == src.stream), None)
    if record is None:
        record = status.sources.add(stream=src.stream)
    record.delivered_seq = src.cursor
    record.dropped_messages = src.dropped
    record.last_seq = max(record.last_seq, src.last_seq, src.cursor)
    status.lag_messages = sum(max(0, s.last_seq - s.delivered_seq) for s in status.sources)


async def refresh(js: JetStreamContext, sources: Sequence[Source], status: pb.LogDrainStatus) -> None:
    """The streams' last sequences (the lag), and what retention removed past a cursor that waits."""
    for src in sources:
        try:
            info = await js.stream_info(src.stream)
        except NotFoundError:
            continue
        src.last_seq = int(info.state.last_seq)
        first = int(info.state.first_seq)
        if src.cursor and first > src.cursor + 1:
            count_dropped(src, status, first - src.cursor - 1)
            src.cursor = first - 1
        write_source(src, status)
