"""Notification channels (docs/notifications.md): ``add_channel``, ``remove_channel``, ``list_channels``,
``send_test``.

A channel is one record (``notifychannel.<name>``) that the secrets service's ``notify`` leader loop
follows (services/secrets/notify.py). Its URL (a Slack or Discord URL is a credential) and its signing
secret are sealed together to the cluster secrets key; the record shows the URL without its path. The
signing secret is returned once, by :func:`add_channel`, for the receiver to verify deliveries.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared import notify
from shared.actions.context import ActionContext, commit_edit, remove_with_status, stamp_replacing, with_status
from shared.actions.names import resolve_project
from shared.actions.refusals import Invalid, NotFound
from shared.backup.sealed import seal_settings
from shared.clock import from_timestamp
from shared.events import make_event
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX

TEST_WAIT = 30.0
"""How long ``notify test`` waits for the delivery's outcome, seconds."""


@dataclass(frozen=True)
class AddChannel:
    name: str
    url: str = field(repr=False)
    """Where deliveries go; sealed (a webhook URL's path is often its token)."""
    format: str = "generic"
    events: list[str] = field(default_factory=list)
    project: str = ""
    console_url: str = ""


@dataclass(frozen=True)
class Channel:
    name: str
    url: str
    """Scheme, host and port only."""
    format: str
    events: list[str]
    project: str
    console_url: str
    delivered: int = 0
    last_delivered_at: float = 0.0
    failing: bool = False
    failing_since: float = 0.0
    failures: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class ChannelAdded:
    channel: Channel
    signing_secret: str = field(repr=False)
    """Shown once: receivers verify ``Zattera-Signature`` with it."""
    replaced: bool


def describe(view_channel: pb.NotifyChannel, status: pb.NotifyStatus | None, project: str) -> Channel:
    """A channel and how its delivery goes, as commands show it."""
    s = status or pb.NotifyStatus()
    return Channel(
        name=view_channel.meta.id,
        url=view_channel.url_shown,
        format=view_channel.format,
        events=list(view_channel.events) or list(notify.DEFAULT_EVENTS),
        project=project,
        console_url=view_channel.console_url,
        delivered=s.delivered,
        last_delivered_at=from_timestamp(s.last_delivered_at),
        failing=s.failing,
        failing_since=from_timestamp(s.failing_since),
        failures=s.failures,
        last_error=s.last_error,
    )


def _check(request: AddChannel) -> None:
    problem = notify.name_problem(request.name)
    if problem:
        raise Invalid("name", problem, said="NAME")
    problem = notify.url_problem(request.url)
    if problem:
        raise Invalid("url", problem, said="--url")
    if request.format not in notify.FORMATS:
        raise Invalid("format", f"{request.format!r} is not one of {', '.join(notify.FORMATS)}", said="--format")
    problem = notify.kinds_problem(request.events)
    if problem:
        raise Invalid("events", problem, said="--events")
    if request.console_url:
        problem = notify.url_problem(request.console_url)
        if problem:
            raise Invalid("console_url", problem, said="--console-url")


async def _next_event_seq(ctx: ActionContext) -> int:
    try:
        info = await ctx.conn.js.stream_info(EVENTS_STREAM)
    except NotFoundError:
        return 1
    return int(info.state.last_seq) + 1


async def add_channel(ctx: ActionContext, request: AddChannel) -> ChannelAdded:
    """Add (or replace) a channel: deliveries start with the events published from now on. A new signing
    secret is made each time (a replaced channel's receivers need the new one)."""
    _check(request)
    project_id = ""
    if request.project:
        project = resolve_project(ctx.view, request.project)
        if project is None:
            raise NotFound(f"no project {request.project!r}", field="project")
        project_id = project.meta.id
    secret = secrets.token_urlsafe(32)
    sealed = seal_settings(ctx.view, {"url": request.url, "secret": secret}, "the channel's URL")
    start_seq = await _next_event_seq(ctx)
    existing = ctx.view.get(K.NOTIFY_CHANNEL, request.name)

    def edit() -> pb.NotifyChannel:
        record = pb.NotifyChannel(
            format=request.format,
            events=sorted(set(request.events)),
            project_id=project_id,
            sealed=sealed.sealed,
            key_id=sealed.key_id,
            url_shown=notify.shown_url(request.url),
            start_seq=start_seq,
            console_url=request.console_url.rstrip("/"),
        )
        record.meta.id = request.name
        stamp_replacing(record, ctx.view.get(K.NOTIFY_CHANNEL, request.name))
        return record

    written = await commit_edit(ctx, f"channel {request.name}", edit)
    assert written is not None
    return ChannelAdded(describe(written, None, request.project), secret, replaced=existing is not None)


@dataclass(frozen=True)
class RemoveChannel:
    name: str


async def remove_channel(ctx: ActionContext, request: RemoveChannel) -> None:
    """Remove a channel and its delivery status (what it has not delivered is not delivered)."""
    await remove_with_status(ctx, K.NOTIFY_CHANNEL, K.NOTIFY_STATUS, request.name, "notification channel")


def list_channels(ctx: ActionContext) -> list[Channel]:
    """Every channel, by name, with how its delivery goes."""
    found = []
    for record, status in with_status(ctx, K.NOTIFY_CHANNEL, pb.NotifyChannel, K.NOTIFY_STATUS, pb.NotifyStatus):
        project = ctx.view.project(record.project_id) if record.project_id else None
        found.append(describe(record, status, project.name if project else record.project_id))
    return found


@dataclass(frozen=True)
class SendTest:
    name: str
    wait: float = TEST_WAIT


@dataclass(frozen=True)
class TestSent:
    name: str
    delivered: bool
    error: str
    """Why the delivery failed, or that no outcome came within the wait ("" when delivered)."""


async def send_test(ctx: ActionContext, request: SendTest) -> TestSent:
    """Publish a ``notify.test`` event for the channel and wait for its delivery (the same path every
    notification takes: the events stream, the ``notify`` loop, the signed request)."""
    if ctx.view.get(K.NOTIFY_CHANNEL, request.name) is None:
        raise NotFound(f"no notification channel {request.name!r}", field="name")
    feed = ctx.view.subscribe({K.NOTIFY_STATUS})
    try:
        before = ctx.view.get(K.NOTIFY_STATUS, request.name)
        failures_before = before.failures if isinstance(before, pb.NotifyStatus) else 0
        event = make_event(
            notify.TEST_KIND,
            f"a test notification for channel {request.name}, sent by {ctx.actor}",
            fields={"channel": request.name, "actor": ctx.actor},
        )
        ack = await ctx.conn.js.publish(
            EVENTS_SUBJECT_PREFIX + event.kind, event.SerializeToString(), stream=EVENTS_STREAM
        )
        deadline = ctx.clock.now() + request.wait
        while True:
            status = ctx.view.get(K.NOTIFY_STATUS, request.name)
            if isinstance(status, pb.NotifyStatus):
                if status.delivered_seq >= ack.seq:
                    return TestSent(request.name, True, "")
                if status.failures > failures_before and status.last_error:
                    return TestSent(request.name, False, status.last_error)
            remaining = deadline - ctx.clock.now()
            if remaining <= 0:
                return TestSent(
                    request.name,
                    False,
                    f"no delivery within {request.wait:.0f}s (is the secrets service running? "
                    "`zattera status`, `zattera events --kind notify.failing`)",
                )
            try:
                await asyncio.wait_for(feed.wait(), remaining)
            except TimeoutError:
                continue
    finally:
        feed.close()
