"""Notifications: which channel takes which event, the message and its signature (tables), and the secrets
service's ``notify`` loop on a real nats-server delivering to real HTTP receivers on loopback that check
every signature: in order, through the receiver's downtime and a restart of the loop, a failing channel
loud and holding up no other; ``notify test``; nothing secret in the records, events or status."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from zattera.v1 import types_pb2 as pb

from services.secrets.delivery import DeliverySettings
from services.secrets.notify import Notifier
from shared import keys as K
from shared import notify
from shared.actions.notify import (
    AddChannel,
    RemoveChannel,
    SendTest,
    add_channel,
    list_channels,
    remove_channel,
    send_test,
)
from shared.actions.refusals import Invalid, NotFound
from shared.clock import RealClock
from shared.connection import Connection
from shared.events import ERROR, EventPublisher, make_event
from shared.loop import LoopDeps
from shared.notify_status import failing_channels
from shared.secrets import Keyring
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests.backup.test_schedule import _cluster
from tests.waiting import eventually

TOKEN = "T0K3N-do-not-leak-7f3a"
FAST = DeliverySettings(timeout=2.0, retry_first=0.05, retry_most=0.2, failing_after=3)


def _channel(name: str = "ops", *, events: tuple[str, ...] = (), project_id: str = "") -> pb.NotifyChannel:
    c = pb.NotifyChannel(format="generic", events=list(events), project_id=project_id)
    c.meta.id = name
    return c


@pytest.mark.parametrize(
    ("channel", "event", "wanted"),
    [
        (_channel(), make_event("deploy.failed", "x"), True),  # a default kind
        (_channel(), make_event("deploy.succeeded", "x"), False),  # not a default
        (_channel(events=("deploy.*",)), make_event("deploy.succeeded", "x"), True),  # a pattern
        (_channel(events=("deploy.*",)), make_event("node.down", "x"), False),
        (_channel(project_id="P1"), make_event("deploy.failed", "x", project_id="P1"), True),
        (_channel(project_id="P1"), make_event("deploy.failed", "x", project_id="P2"), False),
        (_channel(project_id="P1"), make_event("node.down", "x"), False),  # a cluster event is no project's
        (_channel(), make_event("notify.test", "x", fields={"channel": "ops"}), True),  # its own test
        (_channel(), make_event("notify.test", "x", fields={"channel": "other"}), False),
        (_channel(events=("job.failed",)), make_event("notify.test", "x", fields={"channel": "ops"}), True),
        (_channel(), make_event("notify.failing", "x", fields={"channel": "ops"}), False),  # never its own failure
        (_channel(), make_event("notify.failing", "x", fields={"channel": "other"}), True),
    ],
)
def test_which_channel_takes_which_event(channel: pb.NotifyChannel, event: pb.Event, wanted: bool) -> None:
    assert notify.wanted(channel, event) is wanted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"https://hooks.slack.com/services/{TOKEN}", "https://hooks.slack.com/…"),
        ("http://127.0.0.1:9000/", "http://127.0.0.1:9000"),
        (f"https://example.com?token={TOKEN}", "https://example.com/…"),
        ("http://[::1]:8080/x", "http://[::1]:8080/…"),
    ],
)
def test_a_url_is_shown_without_its_path(url: str, shown: str) -> None:
    assert notify.shown_url(url) == shown


def test_a_signature_verifies_and_a_tampered_or_stale_one_does_not() -> None:
    payload = b'{"kind":"deploy.failed"}'
    headers = notify.headers("01EVENT", "s3cret", 1_700_000_000, payload)
    assert notify.verify("s3cret", headers, payload, now=1_700_000_010)
    assert not notify.verify("s3cret", headers, payload + b" ", now=1_700_000_010), "an altered body"
    assert not notify.verify("other", headers, payload, now=1_700_000_010), "another secret"
    assert not notify.verify("s3cret", headers, payload, now=1_700_001_000), "replayed 1000 s later"
    assert headers[notify.EVENT_ID_HEADER] == "01EVENT"


@pytest.mark.parametrize("fmt", notify.FORMATS)
def test_the_message_says_what_where_and_links_the_console(fmt: str) -> None:
    channel = _channel()
    channel.format, channel.console_url = fmt, "https://console.example.com"
    event = make_event("deploy.failed", "a green instance failed to start", severity=ERROR, environment_id="01ENV")
    body = json.loads(notify.body(channel, event, notify.Names(env="shop/web/production")))
    text = {"generic": body.get("text"), "slack": body.get("text"), "discord": body.get("content")}[fmt]
    assert text is not None
    assert "FAILED deploy.failed — shop/web/production" in text
    assert "a green instance failed to start" in text
    assert "https://console.example.com/env/01ENV" in text


# ------------------------------------------------------------------ real components


@dataclass
class Receiver:
    """An HTTP receiver on loopback that checks every delivery's signature (as docs/notifications.md says)."""

    secret: str = ""
    status: int = 200
    got: list[dict[str, object]] = field(default_factory=list)
    bad_signatures: int = 0
    port: int = 0
    runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        payload = await request.read()
        if not notify.verify(self.secret, request.headers, payload, now=time.time()):
            self.bad_signatures += 1
            return web.Response(status=401)
        if self.status == 200:
            self.got.append(json.loads(payload))
        return web.Response(status=self.status)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/hooks/" + TOKEN, self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        if not self.port:
            self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}/hooks/{TOKEN}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def ids(self) -> list[str]:
        return [str(d["id"]) for d in self.got]


@pytest.fixture
async def receivers() -> AsyncIterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        await r.stop()


@pytest.fixture
async def loops() -> AsyncIterator[list[Notifier]]:
    made: list[Notifier] = []
    yield made
    for loop in made:
        await loop.end_term()


async def _start(conn: Connection, view: StateView, keyring: Keyring, made: list[Notifier]) -> Notifier:
    """A leader's term without the lease: its passes start one delivery task per channel."""
    loop = Notifier(LoopDeps(conn, view, RealClock(), coalesce=0.0), lambda: keyring, settings=FAST)
    loop.writer = Writer(conn, view)
    made.append(loop)
    await loop.begin_term()
    await loop.run_pass()
    return loop


async def _seen_events(conn: Connection) -> list[pb.Event]:
    seen: list[pb.Event] = []

    async def got(msg: object) -> None:
        seen.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(f"{EVENTS_SUBJECT_PREFIX}notify.>", cb=got)
    return seen


async def test_deliveries_are_signed_in_order_through_downtime_and_a_restart_and_a_failing_channel_holds_up_none(
    conn: Connection, view: StateView, receivers: list[Receiver], loops: list[Notifier]
) -> None:
    ctx, keyring = await _cluster(conn, view)
    ops, broken = Receiver(), Receiver(status=500)
    receivers += [ops, broken]
    added = await add_channel(ctx, AddChannel("ops", await ops.start(), events=["deploy.failed", "job.failed"]))
    ops.secret = added.signing_secret
    other = await add_channel(ctx, AddChannel("broken", await broken.start(), events=["deploy.*"]))
    broken.secret = other.signing_secret
    notices = await _seen_events(conn)
    events = EventPublisher(conn)
    loop = await _start(conn, view, keyring, loops)

    expected: list[str] = []
    for i in range(5):
        wanted = make_event("deploy.failed", f"release v{i} failed", severity=ERROR, project_id="01PROJ")
        expected.append(wanted.meta.id)
        await events.publish(wanted, make_event("deploy.succeeded", f"v{i} ok"))  # the second: not for ops
    await eventually(lambda: ops.ids() == expected, 15, "ops got the five failures in order")
    assert ops.bad_signatures == 0 and broken.bad_signatures == 0
    await eventually(lambda: bool(failing_channels(view)), 15, "the broken channel is shown FAILING")
    assert [line.split()[2] for line in failing_channels(view)] == ["broken"]
    assert "answered 500" in failing_channels(view)[0]
    await eventually(
        lambda: any(e.kind == notify.FAILING_KIND and e.fields["channel"] == "broken" for e in notices), 10
    )

    # The receiver goes down; then the control plane restarts (a new term reads the cursor from the state).
    await ops.stop()
    for i in range(5, 10):
        wanted = make_event("job.failed", f"job {i} failed", severity=ERROR)
        expected.append(wanted.meta.id)
        await events.publish(wanted)
    await eventually(lambda: view.get(K.NOTIFY_STATUS, "ops").failing, 15, "ops is failing while down")  # type: ignore[union-attr]
    await loop.end_term()
    loops.remove(loop)
    await _start(conn, view, keyring, loops)
    await ops.start()  # the same port
    await eventually(lambda: list(dict.fromkeys(ops.ids())) == expected, 20, "every event, in order, once back")
    assert len(ops.ids()) - len(expected) <= 1, "at least once: at most the one in flight at the restart again"
    await eventually(lambda: not view.get(K.NOTIFY_STATUS, "ops").failing, 10)  # type: ignore[union-attr]
    await eventually(lambda: any(e.kind == notify.RECOVERED_KIND and e.fields["channel"] == "ops" for e in notices), 10)
    assert ops.got[0]["environment"] == "" and ops.got[0]["project"] == "shop", ops.got[0]

    # Nothing secret in what others read: records, status, events.
    for kind in (K.NOTIFY_CHANNEL, K.NOTIFY_STATUS):
        for record in view.all(kind):
            raw = K.encode(record)
            assert TOKEN.encode() not in raw and added.signing_secret.encode() not in raw
    for notice in notices:
        assert TOKEN not in notice.message and added.signing_secret not in notice.message
    listed = {c.name: c for c in list_channels(ctx)}
    assert listed["ops"].url == f"http://127.0.0.1:{ops.port}/…" and listed["broken"].failing


async def test_notify_test_goes_the_way_every_notification_goes(
    conn: Connection, view: StateView, receivers: list[Receiver], loops: list[Notifier]
) -> None:
    ctx, keyring = await _cluster(conn, view)
    good, bad = Receiver(), Receiver(status=503)
    receivers += [good, bad]
    good.secret = (await add_channel(ctx, AddChannel("good", await good.start(), events=["job.failed"]))).signing_secret
    bad.secret = (await add_channel(ctx, AddChannel("bad", await bad.start()))).signing_secret
    await _start(conn, view, keyring, loops)
    done = await send_test(ctx, SendTest("good", wait=15))
    assert done.delivered and [d["kind"] for d in good.got] == [notify.TEST_KIND]
    failed = await send_test(ctx, SendTest("bad", wait=15))
    assert not failed.delivered and "503" in failed.error
    assert good.got[0]["channel"] == "good" and len(good.got) == 1, "the test went to the channel it names only"
    await remove_channel(ctx, RemoveChannel("bad"))
    assert view.get(K.NOTIFY_CHANNEL, "bad") is None and view.get(K.NOTIFY_STATUS, "bad") is None
    with pytest.raises(NotFound, match="no notification channel 'bad'"):
        await send_test(ctx, SendTest("bad", wait=1))


@pytest.mark.parametrize(
    ("request_", "field_"),
    [
        (AddChannel("Bad Name", "http://127.0.0.1:1/x"), "name"),
        (AddChannel("ok", "ftp://127.0.0.1/x"), "url"),
        (AddChannel("ok", "http://user:pw@127.0.0.1/x"), "url"),
        (AddChannel("ok", "http://127.0.0.1/x", format="teams"), "format"),
        (AddChannel("ok", "http://127.0.0.1/x", events=["deploy failed"]), "events"),
        (AddChannel("ok", "http://127.0.0.1/x", console_url="console"), "console_url"),
    ],
)
async def test_bad_input_is_refused_naming_the_field(
    conn: Connection, view: StateView, request_: AddChannel, field_: str
) -> None:
    ctx, _ = await _cluster(conn, view)
    with pytest.raises(Invalid) as refused:
        await add_channel(ctx, request_)
    assert refused.value.field == field_
    assert view.get(K.NOTIFY_CHANNEL, request_.name) is None
    with pytest.raises(NotFound, match="no project 'nosuch'"):
        await add_channel(ctx, AddChannel("ok", "http://127.0.0.1/x", project="nosuch"))


async def test_the_loop_waits_for_nothing_when_there_is_no_channel(
    conn: Connection, view: StateView, loops: list[Notifier]
) -> None:
    _, keyring = await _cluster(conn, view)
    loop = await _start(conn, view, keyring, loops)
    await asyncio.wait_for(loop.run_pass(), 5)
    assert not loop.followers
