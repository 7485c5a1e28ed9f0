"""Notifier (lease ``notify``): events delivered to the notification channels ``zattera notify add`` made.

It runs in the secrets service because a channel's URL and signing secret are sealed to the cluster
secrets key, which only this service holds.

- **one task per channel**, reading ``ZATTERA_EVENTS`` in order from the channel's cursor
  (``notifystatus.<name>.delivered_seq``, written by this fenced leader): a new leader, or a restarted
  service, resumes where the last one stopped. Delivery is at least once: an event delivered just before a
  crash may be delivered again (receivers drop repeats by ``Zattera-Event-Id``); none is skipped.
- **in order per channel, retried with backoff**: a delivery that fails (no answer, not 2xx) is retried
  after ``retry_first`` doubling up to ``retry_most`` seconds; later events wait behind it. After
  ``failing_after`` failed attempts the channel is FAILING (``notify.failing`` event, ``zattera status``),
  until a delivery succeeds (``notify.recovered``). A failing channel holds up no other.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import partial

import aiohttp
from google.protobuf.message import DecodeError
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.v1 import types_pb2 as pb

from services.secrets.delivery import DeliveryLoop, DeliverySettings, clear_failures, save_status, status_of
from shared import keys as K
from shared import notify
from shared.actions.names import env_label
from shared.backup.sealed import open_settings
from shared.clock import stamp
from shared.events import INFO, make_event
from shared.state.feed import guard_ordered_consumer
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX

log = logging.getLogger(__name__)

SKIPPED_FLUSH = 2.0
"""Seconds the cursor may lag over events the channel does not take (it is written at once after a
delivery): at most that much of the stream is read again after a failover."""
CONSUMER_HEARTBEAT = 2.0


@dataclass
class _Target:
    url: str = field(repr=False)
    secret: str = field(repr=False)


class Notifier(DeliveryLoop[DeliverySettings, None]):
    name = "notify"
    target_noun = "channel"
    failing_kind = notify.FAILING_KIND
    kinds = frozenset({K.NOTIFY_CHANNEL})
    _session: aiohttp.ClientSession | None = None

    async def begin_term(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.timeout))

    async def end_term(self) -> None:
        await super().end_term()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run_pass(self) -> None:
        """One task per channel; a changed channel's task starts again, a removed one's stops."""
        channels = {c.meta.id: c for c in self.view.all(K.NOTIFY_CHANNEL) if isinstance(c, pb.NotifyChannel)}
        wanted = {name: (c.SerializeToString(deterministic=True), None) for name, c in channels.items()}
        await self.followers.stop_changed(wanted)
        self.followers.start_missing(wanted, lambda name: self._follow(channels[name]))

    # ------------------------------------------------------------------ one channel

    def _open(self, channel: pb.NotifyChannel) -> _Target:
        opened = open_settings(self.keyring(), channel.sealed, channel.key_id)
        return _Target(opened["url"], opened["secret"])

    def _status(self, name: str) -> pb.NotifyStatus:
        return status_of(self, K.NOTIFY_STATUS, pb.NotifyStatus, name)

    async def _follow(self, channel: pb.NotifyChannel) -> None:
        name = channel.meta.id
        try:
            target = self._open(channel)
        except Exception as exc:
            log.error("notify: channel %s cannot be opened: %s", name, exc)
            status = self._status(name)
            if status.last_error != f"cannot open the channel: {exc}":
                status.last_error = f"cannot open the channel: {exc}"
                await self._save(status)
            return
        await self.keep_following(  # read again from the cursor
            lambda: self._follow_from_cursor(channel, target), f"notify: channel {name}: reading the events"
        )

    async def _follow_from_cursor(self, channel: pb.NotifyChannel, target: _Target) -> None:
        status = self._status(channel.meta.id)
        start = max(status.delivered_seq + 1, channel.start_seq, 1)
        saved = status.delivered_seq
        sub = await self.conn.js.subscribe(
            EVENTS_SUBJECT_PREFIX + ">",
            stream=EVENTS_STREAM,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
            idle_heartbeat=CONSUMER_HEARTBEAT,
            pending_msgs_limit=100_000,
        )
        guard_ordered_consumer(sub, None)
        flushed_at = self.clock.now()
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=SKIPPED_FLUSH)
                except TimeoutError:
                    if status.delivered_seq != saved:
                        await self._save(status)
                        saved, flushed_at = status.delivered_seq, self.clock.now()
                    continue
                seq = msg.metadata.sequence.stream
                try:
                    event: pb.Event | None = pb.Event.FromString(msg.data)
                except DecodeError:
                    event = None
                if event is not None and notify.wanted(channel, event):
                    await self._deliver(channel, target, event, status)  # failures saved with the old cursor
                    status.delivered_seq = seq
                else:
                    status.delivered_seq = seq
                    if self.clock.now() - flushed_at < SKIPPED_FLUSH:
                        continue
                await self._save(status)
                saved, flushed_at = seq, self.clock.now()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _deliver(
        self, channel: pb.NotifyChannel, target: _Target, event: pb.Event, status: pb.NotifyStatus
    ) -> None:
        """Deliver ``event`` until it is accepted, recording failures in ``status`` as they come."""
        payload = notify.body(channel, event, self._names(event))
        backoff = self.settings.backoff()
        while True:
            error = await self._post(target, event.meta.id, payload)
            now = self.clock.now()
            if error is None:
                recovered = clear_failures(status)
                status.delivered += 1
                stamp(status.last_delivered_at, now)
                if recovered:
                    await self._announce(channel, notify.RECOVERED_KIND, "delivers again", INFO)
                return
            await self.record_failure(status, error, self._save, partial(self._announce, channel))
            await self.clock.sleep(next(backoff))

    async def _post(self, target: _Target, event_id: str, payload: bytes) -> str | None:
        """None when the receiver accepted the delivery; else why not (no URL in it: it may hold a token)."""
        assert self._session is not None
        headers = notify.headers(event_id, target.secret, int(time.time()), payload)
        try:
            async with self._session.post(target.url, data=payload, headers=headers, allow_redirects=False) as resp:
                if 200 <= resp.status < 300:
                    return None
                return f"the receiver answered {resp.status} {resp.reason or ''}".rstrip()
        except TimeoutError:
            return f"no answer within {self.settings.timeout:.0f}s"
        except aiohttp.ClientError as exc:
            return f"cannot reach the receiver ({type(exc).__name__})"

    def _names(self, event: pb.Event) -> notify.Names:
        project = self.view.project(event.project_id) if event.project_id else None
        node = self.view.get(K.NODE, event.node_id) if event.node_id else None
        return notify.Names(
            env=env_label(self.view, event.environment_id) if event.environment_id else "",
            project=project.name if project is not None else event.project_id,
            node=(node.name or event.node_id) if isinstance(node, pb.Node) else event.node_id,
        )

    async def _announce(self, channel: pb.NotifyChannel, kind: str, what: str, severity: str) -> None:
        name = channel.meta.id
        message = f"notification channel {name} ({channel.url_shown}) {what}"
        await self.events.publish(
            make_event(kind, message, clock=self.clock, severity=severity, fields={"channel": name})
        )

    async def _save(self, status: pb.NotifyStatus) -> None:
        await save_status(self, K.NOTIFY_STATUS, status)
