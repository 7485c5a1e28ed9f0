"""Drainer (lease ``drains``): app log lines (and, with ``--events``, platform events) shipped to the log drains
``zattera drains add`` made (docs/logs.md "Drains").

It runs in the secrets service because a drain's URL, headers and CA are sealed to the cluster secrets key,
which only this service holds.

- **durable consumers**: a drain reads each of its environments' log streams (``ZATTERA_LOGS_<env>``) and,
  with ``events``, ``ZATTERA_EVENTS``, through a durable pull consumer ``drain_<name>`` (explicit acks). A
  drain down for an hour, a new leader or a restarted service resumes where the consumer's acks stopped.
- **ack after acceptance, in order**: one task per drain fetches, delivers a batch, and acks its messages
  only once the receiver accepted it (a 2xx answer; for syslog, the frames written to the TLS connection);
  the next batch waits. At least once: a batch delivered just before a crash may be delivered again.
- **retry with backoff; failing**: a failed delivery is retried after ``retry_first`` doubling up to
  ``retry_most`` seconds (the held messages are kept in progress meanwhile); after ``failing_after`` failed
  attempts the drain is FAILING (``drain.failing``, ``zattera status``) until a delivery succeeds
  (``drain.recovered``). A drain holds up no other: each has its own task and receiver connection.
- **dropped lines counted**: each stream of a drain holds nothing but what the drain reads, so a jump in the
  stream sequences delivered (or a stream whose first sequence passed the drain's cursor) is messages that
  retention removed before delivery; they are counted in ``logdrainstatus.<name>``.

This module is the loop and the delivery with its retries; what is sent and how is
:mod:`services.secrets.drain_send`, the consumers, cursors and dropped messages
:mod:`services.secrets.drain_cursors`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from services.secrets.delivery import DeliveryLoop, DeliverySettings, clear_failures, save_status, status_of
from services.secrets.drain_cursors import Source, any_made, bind_source, count_dropped, refresh, write_source
from services.secrets.drain_send import Delivery, DrainTarget, Sender, open_target, records_of
from shared import drains
from shared import keys as K
from shared.applogs import app_log_subject, app_logs_stream
from shared.clock import stamp
from shared.events import INFO, env_event
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainSettings(DeliverySettings):
    batch_lines: int = 10_000
    """Most lines in one delivery (one POST, or one write of syslog frames)."""
    fetch_messages: int = 16
    """Log messages (each a batch of up to 8,192 lines of one instance) fetched at once."""
    status_every: float = 1.0
    """Seconds between two writes of the drain's status (its cursors, lag and counters)."""
    idle_wait: float = 1.0
    """How long one fetch waits for new messages, seconds."""
    ack_wait: float = 60.0
    """The consumers' ack wait (at least twice a retry's pause and timeout); held messages are kept in progress
    while a delivery is retried."""


class Drainer(DeliveryLoop[DrainSettings, tuple[str, ...]]):
    """``followers``: each drain's task, with the streams it reads."""

    name = "drains"
    target_noun = "drain"
    failing_kind = drains.FAILING_KIND
    kinds = frozenset({K.LOG_DRAIN, K.ENV})

    def _envs_of(self, drain: pb.LogDrain) -> list[str]:
        if drain.environment_id:
            return [drain.environment_id] if self.view.env(drain.environment_id) is not None else []
        return sorted(e.meta.id for e in self.view.envs() if e.project_id == drain.project_id)

    async def run_pass(self) -> None:
        """One task per drain; a drain whose record or environments changed starts again, a removed one's
        task stops and its consumers are deleted."""
        targets: dict[str, tuple[pb.LogDrain, list[str]]] = {}
        wanted: dict[str, tuple[bytes, tuple[str, ...]]] = {}
        for d in self.view.all(K.LOG_DRAIN):
            if isinstance(d, pb.LogDrain):
                envs = self._envs_of(d)
                version = d.SerializeToString(deterministic=True) + "|".join(envs).encode()
                targets[d.meta.id] = (d, envs)
                wanted[d.meta.id] = (version, self._streams(d, envs))
        for name, streams in await self.followers.stop_changed(wanted):
            kept = set(wanted[name][1]) if name in wanted else set()
            await self._delete_consumers(name, [s for s in streams if s not in kept])
            if name not in wanted and self.view.get(K.LOG_DRAIN_STATUS, name) is not None:
                assert self.writer is not None  # removed: the status its task may have written meanwhile goes
                await self.writer.commit(self.writer.txn("drains").delete(K.log_drain_status(name)))
        self.followers.start_missing(wanted, lambda name: self._follow(*targets[name]))

    @staticmethod
    def _streams(drain: pb.LogDrain, envs: list[str]) -> tuple[str, ...]:
        return tuple(app_logs_stream(e) for e in envs) + ((EVENTS_STREAM,) if drain.events else ())

    async def _delete_consumers(self, name: str, streams: Sequence[str]) -> None:
        for stream in streams:
            with contextlib.suppress(Exception):
                await self.conn.js.delete_consumer(stream, drains.consumer_name(name))

    # ------------------------------------------------------------------ one drain

    def _status(self, name: str) -> pb.LogDrainStatus:
        return status_of(self, K.LOG_DRAIN_STATUS, pb.LogDrainStatus, name)

    async def _follow(self, drain: pb.LogDrain, envs: list[str]) -> None:
        name = drain.meta.id
        try:
            target = open_target(self.keyring(), drain)
        except Exception as exc:
            log.error("drains: drain %s cannot be opened: %s", name, type(exc).__name__)
            status = self._status(name)
            status.last_error = "cannot open the drain's sealed settings (rotated key not held?)"
            if self._changed(status):
                await self._save(status)
            return
        await self.keep_following(  # a stream deleted with its env: again from the consumers
            lambda: self._run_drain(drain, envs, target), f"drains: drain {name}: reading the logs"
        )

    async def _run_drain(self, drain: pb.LogDrain, envs: list[str], target: DrainTarget) -> None:
        status = self._status(drain.meta.id)
        streams = self._streams(drain, envs)
        for gone in [s for s in status.sources if s.stream not in streams]:  # an env deleted or left the drain
            status.sources.remove(gone)
        sources = [Source(app_logs_stream(e), app_log_subject(e, "*"), e) for e in envs]
        if drain.events:
            sources.append(Source(EVENTS_STREAM, EVENTS_SUBJECT_PREFIX + ">", ""))
        ready: list[Source] = []
        for src in sources:
            try:
                await bind_source(
                    self.conn.js,
                    drain,
                    src,
                    status,
                    ack_wait=max(self.settings.ack_wait, 2 * (self.settings.retry_most + self.settings.timeout)),
                    max_ack_pending=self.settings.fetch_messages * 4,
                )
                ready.append(src)
            except NotFoundError:
                log.info("drains: drain %s: no stream %s yet", drain.meta.id, src.stream)
        sender = Sender(target, self.settings.timeout)
        wait = max(0.05, self.settings.idle_wait / max(1, len(ready)))
        saved_at = self.clock.now()
        try:
            while True:
                for src in ready:
                    try:
                        assert src.sub is not None
                        msgs = await src.sub.fetch(self.settings.fetch_messages, timeout=wait)
                    except TimeoutError:
                        continue
                    await self._ship(drain, envs, target, sender, src, msgs, status)
                if not ready:
                    await self.clock.sleep(self.settings.idle_wait)
                if self.clock.now() - saved_at >= self.settings.status_every:
                    await refresh(self.conn.js, ready, status)
                    if self._changed(status):  # an idle drain writes nothing
                        await self._save(status)
                    saved_at = self.clock.now()
                    if await any_made(self.conn.js, (src for src in sources if src not in ready)):
                        return  # a stream made since (a new env's first lines): the caller binds it
        finally:
            await sender.close()
            for src in ready:
                with contextlib.suppress(Exception):
                    if src.sub is not None:
                        await src.sub.unsubscribe()

    async def _ship(
        self,
        drain: pb.LogDrain,
        envs: list[str],
        target: DrainTarget,
        sender: Sender,
        src: Source,
        msgs: list[Msg],
        status: pb.LogDrainStatus,
    ) -> None:
        cursor, dropped = src.cursor, 0
        records: list[drains.Record] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= cursor:
                continue  # delivered before a crash, its ack lost: not again
            if cursor and seq > cursor + 1:
                dropped += seq - cursor - 1
            cursor = seq
            found = records_of(self.view, drain, envs, src.env_id, msg)
            src.messages += 1
            src.lines += len(found)
            records.extend(found)
        step = self.settings.batch_lines
        for start in range(0, len(records), step):
            await self._deliver(drain, target, sender, records[start : start + step], msgs, status)
        if dropped:
            count_dropped(src, status, dropped)
        src.cursor = cursor
        status.delivered_lines += len(records)
        if records:
            stamp(status.last_delivered_at, self.clock.now())
        for msg in msgs:
            await msg.ack()
        write_source(src, status)

    async def _deliver(
        self,
        drain: pb.LogDrain,
        target: DrainTarget,
        sender: Sender,
        records: list[drains.Record],
        held: list[Msg],
        status: pb.LogDrainStatus,
    ) -> None:
        """Deliver ``records`` until the receiver accepts them, recording failures in ``status``."""
        payload = drains.encode(drain.scheme, records, observed_ns=time.time_ns())
        backoff = self.settings.backoff()
        while True:
            try:
                await sender.send(payload)
            except Delivery as exc:
                error = drains.scrub(str(exc), target.secrets)
            else:
                if status.failures:
                    recovered = clear_failures(status)
                    await self._save(status)
                    if recovered:
                        await self._announce(drain, drains.RECOVERED_KIND, "delivers again", INFO)
                return
            await self.record_failure(status, error, self._save, partial(self._announce, drain))
            for msg in held:
                with contextlib.suppress(Exception):
                    await msg.in_progress()
            await self.clock.sleep(next(backoff))

    async def _announce(self, drain: pb.LogDrain, kind: str, what: str, severity: str) -> None:
        name = drain.meta.id
        message = f"log drain {name} ({drain.url_shown}) {what}"
        await self.events.publish(
            env_event(kind, message, drain, clock=self.clock, severity=severity, fields={"drain": name})
        )

    def _changed(self, status: pb.LogDrainStatus) -> bool:
        """Whether ``status`` differs from the one stored, its write time aside."""
        stored = self.view.get(K.LOG_DRAIN_STATUS, status.meta.id)
        if not isinstance(stored, pb.LogDrainStatus):
            return True
        mine, theirs = pb.LogDrainStatus(), pb.LogDrainStatus()
        mine.CopyFrom(status)
        theirs.CopyFrom(stored)
        mine.meta.ClearField("updated_at")
        theirs.meta.ClearField("updated_at")
        return mine != theirs

    async def _save(self, status: pb.LogDrainStatus) -> None:
        await save_status(self, K.LOG_DRAIN_STATUS, status)
