"""Watches: a reader follows a stream through a pull consumer that *control* creates for it.

Only control may create consumers on a secured cluster (SECURITY.md): a consumer's deliver subject is in
the stream's account, so whoever creates one could point its deliveries at a lease key. The CLI's watches
(deploy progress, ``logs -f``, ``events -f``, build logs) therefore ask ``zattera.watch.open`` with a
:class:`WatchSpec` (stream, filter subjects, where to start); the join service (control credential) creates
an ephemeral pull consumer — no deliver subject, no acks, in memory, gone after
:data:`WATCH_INACTIVE_THRESHOLD` without pulls — and answers its name. The reader then pulls it
(:class:`Watch`, on :class:`shared.pull.PullFeed`); the pulled messages come back through the reply
mapping of the operator's import, like every other reply.

The same request is made on an open cluster (one code path); only when no control service answers at all
(a development cluster running no join service) does the reader create the same consumer itself, which
an operator credential is refused.

The control side (answering ``zattera.watch.open``) is :mod:`shared.watch_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.backoff import resubscribing
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.pull import PullFeed, PullLost
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.tasks import cancel_and_wait
from shared.teams import (
    FEED_CAUGHT_UP,
    FEED_HEARTBEAT,
    FEED_KEEPALIVE,
    FEED_PENDING_HEADER,
    FEED_SEQ_HEADER,
    FEED_STATUS_HEADER,
    FEED_SUBJECT_HEADER,
    TEAMS_FEED_KEEP_SUBJECT,
    TEAMS_FEED_SUBJECT,
    StreamPosition,
    StreamSeq,
    push_subject,
)

log = logging.getLogger(__name__)

WATCH_OPEN_SUBJECT = "zattera.watch.open"
"""An operator (or any reader) asks control for a watch consumer; the join service answers."""
WATCH_INACTIVE_THRESHOLD = 30.0
"""A watch nobody pulls (its reader exited) is removed by the server after this long."""
WATCH_REQUEST_TIMEOUT = 5.0
MAX_FILTERS = 64
_DELIVER = {
    "all": DeliverPolicy.ALL,
    "new": DeliverPolicy.NEW,
    "last_per_subject": DeliverPolicy.LAST_PER_SUBJECT,
    "by_start_sequence": DeliverPolicy.BY_START_SEQUENCE,
    "by_start_time": DeliverPolicy.BY_START_TIME,
}


class BadWatch(ZatteraError):
    """A watch request that names no stream, no subject or an unknown start."""


class WatchUnavailable(ZatteraError):
    """Nobody could open the watch (no control service answered, and this credential may not)."""


@dataclass(frozen=True)
class WatchSpec:
    """What to follow: ``subjects`` of ``stream`` from ``deliver`` (``start_seq`` / ``start_time_ns`` for the
    ``by_start_*`` policies)."""

    stream: str
    subjects: tuple[str, ...]
    deliver: str = "all"
    start_seq: int = 0
    start_time_ns: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "stream": self.stream,
                "subjects": list(self.subjects),
                "deliver": self.deliver,
                "start_seq": self.start_seq,
                "start_time_ns": self.start_time_ns,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WatchSpec:
        """The spec of a request; raises :class:`BadWatch` naming the bad field."""
        try:
            body = json.loads(data or b"{}")
        except ValueError as exc:
            raise BadWatch(f"bad watch request: not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise BadWatch("bad watch request: expected a JSON object")
        stream, subjects, deliver = body.get("stream"), body.get("subjects"), body.get("deliver", "all")
        if not isinstance(stream, str) or not stream or any(c in stream for c in ".*> "):
            raise BadWatch("stream: a stream name")
        if (
            not isinstance(subjects, list)
            or not 0 < len(subjects) <= MAX_FILTERS
            or not all(isinstance(s, str) and s and " " not in s for s in subjects)
        ):
            raise BadWatch(f"subjects: 1 to {MAX_FILTERS} subjects")
        if deliver not in _DELIVER:
            raise BadWatch(f"deliver: one of {', '.join(_DELIVER)}")
        start_seq, start_time_ns = body.get("start_seq", 0), body.get("start_time_ns", 0)
        if not isinstance(start_seq, int) or start_seq < 0:
            raise BadWatch("start_seq: a stream sequence")
        if not isinstance(start_time_ns, int) or start_time_ns < 0:
            raise BadWatch("start_time_ns: nanoseconds since the epoch")
        return cls(stream, tuple(subjects), deliver, start_seq, start_time_ns)

    def consumer_config(self, name: str) -> ConsumerConfig:
        config = ConsumerConfig(
            name=name,
            deliver_policy=_DELIVER[self.deliver],
            ack_policy=AckPolicy.NONE,
            inactive_threshold=WATCH_INACTIVE_THRESHOLD,
            mem_storage=True,
            num_replicas=1,
        )
        if len(self.subjects) == 1:
            config.filter_subject = self.subjects[0]
        else:
            config.filter_subjects = list(self.subjects)
        if self.deliver == "by_start_sequence":
            config.opt_start_seq = max(self.start_seq, 1)
        elif self.deliver == "by_start_time":
            config.opt_start_time = datetime.fromtimestamp(self.start_time_ns / 1e9, tz=UTC)
        return config

    def resumed_after(self, seq: int) -> WatchSpec:
        """The same watch continuing after stream sequence ``seq`` (its consumer was lost)."""
        return WatchSpec(self.stream, self.subjects, "by_start_sequence", seq + 1)


async def create_watch_consumer(conn: Connection, spec: WatchSpec) -> str:
    """Create the pull consumer of ``spec`` (control's side of ``zattera.watch.open``); returns its name."""
    name = f"watch-{uuid.uuid4().hex[:20]}"
    await conn.js.add_consumer(spec.stream, spec.consumer_config(name))
    return name


async def open_watch(conn: Connection, spec: WatchSpec, timeout: float = WATCH_REQUEST_TIMEOUT) -> str:
    """Ask control for a watch consumer; without any control service (an open development cluster) create
    it directly. Raises :class:`WatchUnavailable` or :class:`BadWatch`."""
    try:
        msg = await conn.nc.request(WATCH_OPEN_SUBJECT, spec.to_json(), timeout=timeout)
    except nats.errors.NoRespondersError:
        try:
            return await create_watch_consumer(conn, spec)
        except (nats.errors.Error, TimeoutError) as exc:
            raise WatchUnavailable(
                f"no control service answered {WATCH_OPEN_SUBJECT} (the join service serves it) and this "
                f"credential may not create the consumer itself ({exc or type(exc).__name__})"
            ) from None
    except nats.errors.TimeoutError:
        raise WatchUnavailable(f"no answer on {WATCH_OPEN_SUBJECT} within {timeout:.0f}s") from None
    reply = json.loads(msg.data or b"{}")
    if "error" in reply:
        raise BadWatch(str(reply["error"]))
    return str(reply["consumer"])


class Watch:
    """Follows a watch consumer: the part of a nats-py subscription its readers use (:meth:`next_msg`,
    :meth:`unsubscribe`), or a callback per message. :attr:`caught_up` is set once everything stored when
    it opened has been delivered. A lost consumer (its server gone, expired) is opened again after the last
    message delivered, so the reader sees every message once, in order, as with an ordered consumer."""

    def __init__(
        self,
        conn: Connection,
        spec: WatchSpec,
        cb: Callable[[Msg], Awaitable[None]] | None = None,
        *,
        caught_up: asyncio.Event | None = None,
    ) -> None:
        self._conn = conn
        self._spec = spec
        self._cb = cb
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._last_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._end = Msg(_client=conn.nc, subject="")
        """Queued after the last message once a feed is refused (:class:`FeedWatch`): the reader then waits on
        the queue alone, with no other future per message."""
        self.refused = ""
        self.caught_up = caught_up or asyncio.Event()
        self._set_up()

    def _set_up(self) -> None:
        """What a kind of watch keeps besides (called last by ``__init__``)."""

    async def start(self) -> Watch:
        consumer = await open_watch(self._conn, self._spec)
        self._task = asyncio.create_task(self._follow(consumer))
        return self

    async def _follow(self, consumer: str) -> None:
        backoff = resubscribing()
        while True:
            feed = PullFeed(self._conn.nc, self._spec.stream, consumer, self._deliver, self.caught_up.set)
            try:
                await feed.run()
            except PullLost as exc:
                log.info("watch of %s lost (%s): opening it again", self._spec.stream, exc)
            while True:
                spec = self._spec.resumed_after(self._last_seq) if self._last_seq else self._spec
                try:
                    consumer = await open_watch(self._conn, spec)
                    break
                except (WatchUnavailable, BadWatch) as exc:
                    delay = next(backoff)
                    log.warning("watch of %s not reopened, retrying in %.1fs: %s", self._spec.stream, delay, exc)
                    await asyncio.sleep(delay)

    async def _deliver(self, msg: Msg) -> None:
        try:
            meta = msg.metadata
        except Exception:  # not a stream message
            return
        if meta.sequence.stream <= self._last_seq:
            return  # delivered before the consumer was re-opened
        self._last_seq = meta.sequence.stream
        if self._cb is not None:
            await self._cb(msg)
        else:
            self._queue.put_nowait(msg)
        if meta.num_pending == 0:
            self.caught_up.set()

    async def next_msg(self, timeout: float | None = None) -> Msg:
        """The next message; raises :class:`TimeoutError` after ``timeout`` seconds without one, and
        :class:`BadWatch` once a feed was refused (:class:`FeedWatch`)."""
        msg = await asyncio.wait_for(self._queue.get(), timeout)
        if msg is self._end:
            self._queue.put_nowait(msg)  # every later call is refused too
            raise BadWatch(self.refused)
        return msg

    def _refuse(self, why: str) -> None:
        """A refused feed: the reader gets what was queued before, then :class:`BadWatch`."""
        if not self.refused:
            self.refused = why
            self._queue.put_nowait(self._end)

    async def next_stored(self, timeout: float) -> Msg | None:
        """The next message stored when the watch opened, or None once there is none left (or none within
        ``timeout``)."""
        if self._queue.empty() and self.caught_up.is_set():
            return None
        got = asyncio.ensure_future(self._queue.get())
        done = asyncio.ensure_future(self.caught_up.wait())
        try:
            await asyncio.wait({got, done}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            if not got.done():
                got.cancel()
        found = got.result() if got.done() and not got.cancelled() else None
        if found is self._end:
            self._queue.put_nowait(found)  # the refusal is for next_msg
            return None
        return found

    async def unsubscribe(self) -> None:
        # Re-cancelled until it ends: asyncio.wait_for (inside the pull) can swallow a cancellation.
        await cancel_and_wait(self._task)


async def follow(
    conn: Connection,
    spec: WatchSpec,
    cb: Callable[[Msg], Awaitable[None]] | None = None,
    *,
    caught_up: asyncio.Event | None = None,
) -> Watch:
    """Open a watch and start following it (stop with :meth:`Watch.unsubscribe`). A team member (whose watch
    control refuses: it pulls no consumer) gets the same messages pushed by the authorising path instead
    (:class:`FeedWatch`, docs/teams.md)."""
    try:
        return await Watch(conn, spec, cb, caught_up=caught_up).start()
    except BadWatch as exc:
        if TEAMS_FEED_SUBJECT not in str(exc):
            raise
    return await FeedWatch(conn, spec, cb, caught_up=caught_up).start()


class FeedMsg(Msg):
    """A message pushed on a member's feed: the stream's subject, sequence and pending count come as headers
    (a message re-published by control cannot keep its stream subject or JetStream reply)."""

    _feed_meta: StreamPosition

    @property
    def metadata(self) -> Any:
        return self._feed_meta


def feed_msg(nc: Any, msg: Msg) -> Msg | None:
    """The stream message a pushed message carries (None: a status message; a JetStream delivery as it is)."""
    if not msg.headers:
        return msg  # a JetStream delivery of a message stored without headers (a log batch)
    headers = dict(msg.headers)
    if FEED_STATUS_HEADER in headers or "Status" in headers:  # ours, or JetStream's idle heartbeat
        return None
    if FEED_SUBJECT_HEADER not in headers:
        return msg  # pushed by JetStream itself (a log feed): its subject and reply are the stream's
    subject = headers.pop(FEED_SUBJECT_HEADER, "")
    seq = int(headers.pop(FEED_SEQ_HEADER, "0") or 0)
    pending = int(headers.pop(FEED_PENDING_HEADER, "0") or 0)
    found = FeedMsg(_client=nc, subject=subject, reply="", data=msg.data, headers=headers or None)
    found._feed_meta = StreamPosition(StreamSeq(seq), pending)
    return found


def _user_key(conn: Connection) -> str:
    """The caller's user public key, as its private inbox prefix names it ("" without a credential)."""
    prefix = bytes(getattr(conn.nc, "_inbox_prefix", b"") or b"").decode()
    return prefix.removeprefix("_INBOX").lstrip(".")


class FeedWatch(Watch):
    """A team member's watch: control follows the stream and pushes what the member may read on a subject only
    it may subscribe to (``zattera.teams.feed``; docs/teams.md). Same reading interface as :class:`Watch`;
    kept alive by a keepalive every FEED_KEEPALIVE s, opened again after the last message when control goes
    silent (no heartbeat) or the feed ends without a refusal. A refusal (``end: not authorised…``) stops it:
    :meth:`next_msg` then raises :class:`BadWatch`."""

    def _set_up(self) -> None:
        self._id = ""
        self._sub: Any = None
        self._heard = 0.0
        self._ended: asyncio.Event = asyncio.Event()

    async def _open(self, spec: WatchSpec) -> None:
        nc = self._conn.nc
        user = _user_key(self._conn)
        if not user:
            raise BadWatch("a feed needs a member credential")
        self._id = uuid.uuid4().hex[:20]
        # Subscribed before asking: control starts pushing as soon as it opens the feed.
        self._sub = await nc.subscribe(push_subject(user, self._id), cb=self._on_push)
        body = json.loads(spec.to_json()) | {"id": self._id}
        try:
            msg = await nc.request(TEAMS_FEED_SUBJECT, json.dumps(body).encode(), timeout=WATCH_REQUEST_TIMEOUT)
            reply = json.loads(msg.data or b"{}")
        except (nats.errors.Error, TimeoutError) as exc:
            await self._drop()
            raise WatchUnavailable(f"no answer on {TEAMS_FEED_SUBJECT}: {exc or type(exc).__name__}") from None
        if "error" in reply:
            await self._drop()
            raise BadWatch(str(reply["error"]))
        self._heard = time.monotonic()

    async def _drop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def start(self) -> FeedWatch:
        await self._open(self._spec)
        self._task = asyncio.create_task(self._keep())
        return self

    async def _on_push(self, msg: Msg) -> None:
        self._heard = time.monotonic()
        status = (msg.headers or {}).get(FEED_STATUS_HEADER, "")
        if status == FEED_CAUGHT_UP:
            self.caught_up.set()
        elif status.startswith("end: "):
            why = status.removeprefix("end: ")
            if why.startswith("not authorised"):
                self._refuse(why)
            self._ended.set()
        found = feed_msg(self._conn.nc, msg)
        if found is not None:
            await self._deliver(found)

    async def _keep(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._ended.wait(), FEED_KEEPALIVE)
            except TimeoutError:
                pass
            if self.refused:
                await self._drop()
                return
            silent = time.monotonic() - self._heard > 3 * FEED_HEARTBEAT
            if self._ended.is_set() or silent:
                self._ended.clear()
                await self._drop()
                spec = self._spec.resumed_after(self._last_seq) if self._last_seq else self._spec
                try:
                    await self._open(spec)
                except (WatchUnavailable, BadWatch) as exc:
                    log.warning("feed of %s not reopened: %s", self._spec.stream, exc)
                    if "not authorised" in str(exc):
                        self._refuse(str(exc))
                        return
                continue
            with contextlib.suppress(nats.errors.Error):
                await self._conn.nc.publish(TEAMS_FEED_KEEP_SUBJECT, json.dumps({"id": self._id}).encode())

    async def unsubscribe(self) -> None:
        await cancel_and_wait(self._task)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._conn.nc.publish(
                    TEAMS_FEED_KEEP_SUBJECT, json.dumps({"id": self._id, "close": True}).encode()
                )
        await self._drop()


STATE_WATCH = WatchSpec(STATE_STREAM, (f"{STATE_PREFIX}>",), deliver="last_per_subject")
"""What a following CLI view pulls: the last value of every key, then every change."""


def watch_opener(conn: Connection, spec: WatchSpec = STATE_WATCH) -> Callable[[], Awaitable[str]]:
    """An ``open_consumer`` for :class:`shared.view.StateView`: each resync asks for a new watch."""

    async def opener() -> str:
        return await open_watch(conn, spec)

    return opener
