"""Members' feeds (docs/teams.md, "Feeds"): what a team member follows is pushed to it.

A member pulls no consumer; :func:`shared.watches.follow` asks ``zattera.teams.feed`` instead, and the join
service (:class:`Feeds`, on the checks of :class:`shared.security.authz.Authz`) pushes to
``zattera.push.<its user key>.<id>``: the state and events streams filtered message by message (control follows
them with a watch of its own and re-publishes what passes), a granted environment's log stream delivered by a
JetStream push consumer straight to that subject. ``zattera.teams.feedkeep`` keeps a feed (and re-checks the
caller's record); a refused caller's feed ends with ``Zattera-Feed: end: not authorised: …``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import nats.errors
from nats.aio.msg import Msg
from zattera.v1 import types_pb2 as pb

from shared.applogs import APP_LOGS_SUBJECT_PREFIX, env_of_stream
from shared.connection import Connection
from shared.security.authz import Authz
from shared.security.callers import Caller, answerable, caller
from shared.subjects import EVENTS_STREAM, STATE_STREAM
from shared.teams import (
    FEED_CAUGHT_UP,
    FEED_HEARTBEAT,
    FEED_HEARTBEAT_STATUS,
    FEED_IDLE,
    FEED_PENDING_HEADER,
    FEED_RECHECK,
    FEED_SEQ_HEADER,
    FEED_STATUS_HEADER,
    FEED_SUBJECT_HEADER,
    Member,
    push_subject,
)
from shared.watches import BadWatch, Watch, WatchSpec, WatchUnavailable, follow


@dataclass
class _Feed:
    """A member's pushed feed: the stream control follows for it and the subject only it may subscribe to."""

    who: Caller
    member: Member
    subject: str
    stream: str
    watch: Watch | None = None
    consumer: str = ""
    """A pushed consumer's name (a feed JetStream delivers itself)."""
    task: asyncio.Future[None] | None = None
    checked: float = 0.0
    """When the caller's record was last read (the authorising path's clock)."""
    kept: float = field(default_factory=time.monotonic)
    sent: float = field(default_factory=time.monotonic)
    ended: bool = False


FEED_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


class Feeds:
    """The handlers of ``zattera.teams.feed`` and ``zattera.teams.feedkeep`` and the feeds this join service
    holds; who may read what is :class:`Authz`'s."""

    def __init__(self, conn: Connection, authz: Authz) -> None:
        self._conn = conn
        self._authz = authz
        self._feeds: dict[tuple[str, str], _Feed] = {}
        self._closing: set[asyncio.Future[None]] = set()

    def feed_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """``zattera.teams.feed``: open a pushed feed of a stream for a member (docs/teams.md, "Feeds")."""

        async def on_feed(msg: Msg) -> None:
            if not answerable(msg):
                return
            try:
                reply = await self._open_feed(caller(msg), msg.data)
            except (BadWatch, WatchUnavailable) as exc:
                reply = {"error": str(exc)}
            except (TimeoutError, nats.errors.Error) as exc:
                reply = {"error": f"feed not opened: {exc or type(exc).__name__}"}
            await self._conn.nc.publish(msg.reply, json.dumps(reply).encode())

        return on_feed

    def keep_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """``zattera.teams.feedkeep`` (every join service gets it): a reader's keepalive or close of its feed."""

        async def on_keep(msg: Msg) -> None:
            who = caller(msg)
            try:
                request = json.loads(msg.data or b"{}")
                feed_id = str(request.get("id", ""))
            except (ValueError, AttributeError):
                return
            feed = self._feeds.get((who.user, feed_id)) if who is not None and self._authz.is_member(who) else None
            if feed is None:
                return
            if request.get("close"):
                await self._end_feed(feed, "")
                return
            feed.kept = time.monotonic()
            await self._recheck(feed, force=True)

        return on_keep

    async def _open_feed(self, who: Caller | None, body: bytes) -> dict[str, str]:
        if who is None or not self._authz.is_member(who):
            raise BadWatch("not authorised: feeds are for team members (others open watches)")
        member = await self._authz.member(who)
        if isinstance(member, str):
            raise BadWatch(f"not authorised: {member}")
        try:
            feed_id = str(json.loads(body or b"{}").get("id", ""))
        except (ValueError, AttributeError):
            feed_id = ""
        if not FEED_ID.match(feed_id):
            raise BadWatch("id: 1-40 of a-z, A-Z, 0-9, '-', '_'")
        spec = WatchSpec.from_json(body)
        if spec.stream not in (STATE_STREAM, EVENTS_STREAM):
            env_id = env_of_stream(spec.stream)
            logs = bool(env_id) and all(s.startswith(f"{APP_LOGS_SUBJECT_PREFIX}{env_id}.") for s in spec.subjects)
            if not member.admin and not (logs and await self._authz.stream_allowed(member, spec.stream)):
                raise BadWatch(
                    f"not authorised: stream {spec.stream}: team members follow the state, their projects' "
                    "events and their environments' logs"
                )
        old = self._feeds.pop((who.user, feed_id), None)
        if old is not None:
            await self._end_feed(old, "")
        feed = _Feed(who, member, push_subject(who.user, feed_id), spec.stream, checked=self._authz.now())
        self._feeds[(who.user, feed_id)] = feed
        try:
            if spec.stream in (STATE_STREAM, EVENTS_STREAM):
                # Filtered message by message: control follows the stream and re-publishes what passes.
                feed.watch = await follow(self._conn, spec, partial(self._forward, feed))
            else:
                # A log stream (or, for an admin, any other stream): nothing to filter, so JetStream pushes it
                # straight to the member's subject (no hop through control; the subject, sequence and pending
                # count travel as in any delivery). Gone 30 s after the member stops listening, or at its end.
                config = spec.consumer_config(f"feed-{uuid.uuid4().hex[:20]}")
                config.deliver_subject = feed.subject
                config.idle_heartbeat = FEED_HEARTBEAT
                info = await self._conn.js.add_consumer(spec.stream, config)
                feed.consumer = str(info.name)
                if not info.num_pending:
                    await self._status(feed, FEED_CAUGHT_UP)
        except BaseException:
            self._feeds.pop((who.user, feed_id), None)
            raise
        feed.task = asyncio.ensure_future(self._tend(feed))
        return {"subject": feed.subject}

    async def _recheck(self, feed: _Feed, *, force: bool = False) -> bool:
        """The caller's record read again (at most every FEED_RECHECK s unless forced); False: the feed ended."""
        now = self._authz.now()
        if not force and now - feed.checked < FEED_RECHECK:
            return True
        feed.checked = now
        member = await self._authz.member(feed.who)
        if isinstance(member, str):
            await self._end_feed(feed, f"not authorised: {member}")
            return False
        feed.member = member
        if feed.stream not in (STATE_STREAM, EVENTS_STREAM) and not await self._authz.stream_allowed(
            member, feed.stream
        ):
            await self._end_feed(feed, f"not authorised: stream {feed.stream} is not readable with your grants")
            return False
        return True

    async def _visible(self, feed: _Feed, msg: Msg) -> bool:
        member = feed.member
        if member.admin:
            return True
        if feed.stream == EVENTS_STREAM:
            try:
                return bool(member.role(pb.Event.FromString(msg.data).project_id))
            except Exception:
                return False
        if feed.stream != STATE_STREAM:
            return True  # a log stream of a granted environment (checked when opened and at each recheck)
        return await self._authz.visible_state(member, msg)

    async def _forward(self, feed: _Feed, msg: Msg) -> None:
        if feed.ended or not await self._recheck(feed):
            return
        if not await self._visible(feed, msg):
            return
        meta = msg.metadata
        headers = dict(msg.headers or {}) | {
            FEED_SUBJECT_HEADER: msg.subject,
            FEED_SEQ_HEADER: str(meta.sequence.stream),
            FEED_PENDING_HEADER: str(meta.num_pending),
        }
        feed.sent = time.monotonic()
        await self._conn.nc.publish(feed.subject, msg.data, headers=headers)

    async def _status(self, feed: _Feed, status: str) -> None:
        feed.sent = time.monotonic()
        await self._conn.nc.publish(feed.subject, b"", headers={FEED_STATUS_HEADER: status})

    async def _tend(self, feed: _Feed) -> None:
        """Tells the reader once the stored messages are all sent, then heartbeats; ends a forgotten feed."""
        with contextlib.suppress(nats.errors.Error):
            if feed.watch is not None:
                await feed.watch.caught_up.wait()
                await self._status(feed, FEED_CAUGHT_UP)
            while not feed.ended:
                await asyncio.sleep(FEED_HEARTBEAT)
                if time.monotonic() - feed.kept > FEED_IDLE:
                    await self._end_feed(feed, "no keepalive")
                    return
                if feed.watch is not None and time.monotonic() - feed.sent >= FEED_HEARTBEAT:
                    await self._status(feed, FEED_HEARTBEAT_STATUS)  # a pushed consumer has JetStream's own

    async def _end_feed(self, feed: _Feed, why: str) -> None:
        if feed.ended:
            return
        feed.ended = True
        if self._feeds.get((feed.who.user, feed.subject.rsplit(".", 1)[-1])) is feed:
            del self._feeds[(feed.who.user, feed.subject.rsplit(".", 1)[-1])]
        if why:
            with contextlib.suppress(nats.errors.Error):
                await self._status(feed, f"end: {why}")
        if feed.watch is not None:
            watch, feed.watch = feed.watch, None
            # In a task of its own: this may run inside the watch's own callback.
            closing = asyncio.ensure_future(watch.unsubscribe())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if feed.consumer:
            closing = asyncio.ensure_future(self._delete_consumer(feed.stream, feed.consumer))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if feed.task is not None and feed.task is not asyncio.current_task():
            feed.task.cancel()

    async def _delete_consumer(self, stream: str, name: str) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self._conn.js.delete_consumer(stream, name)

    async def stop(self) -> None:
        for feed in list(self._feeds.values()):
            await self._end_feed(feed, "")
