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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import drains
from shared import keys as K
from shared.actions.names import env_label
from shared.applogs import app_log_subject, app_logs_stream
from shared.backoff import Backoff
from shared.backup.sealed import open_settings
from shared.clock import stamp
from shared.errors import ZatteraError
from shared.events import ERROR, INFO, make_event
from shared.loop import LeaderLoop, LoopDeps
from shared.secrets import Keyring
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX
from shared.tasks import cancel_and_wait
from shared.txn import Deposed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainSettings:
    timeout: float = 10.0
    """Seconds one delivery may take."""
    retry_first: float = 1.0
    retry_most: float = 60.0
    failing_after: int = 3
    """Failed attempts in a row after which the drain is FAILING."""
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


@dataclass
class _Running:
    task: asyncio.Task[None]
    version: bytes
    streams: tuple[str, ...]


@dataclass
class _Source:
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


@dataclass
class _Target:
    endpoint: drains.Endpoint = field(repr=False)
    ca: str = field(repr=False)
    secrets: tuple[str, ...] = field(repr=False)
    """Every credential, to scrub from error messages."""


class Delivery(ZatteraError):
    """A delivery the receiver did not accept; the message names no credential."""


class _Sender:
    """One drain's connection to its receiver."""

    def __init__(self, target: _Target, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        e = target.endpoint
        self._ssl: ssl.SSLContext | None = None
        if e.tls:
            self._ssl = ssl.create_default_context(cadata=target.ca or None)
        self._session: aiohttp.ClientSession | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None

    async def send(self, payload: bytes) -> None:
        try:
            if self.target.endpoint.scheme == drains.SYSLOG_TLS:
                await asyncio.wait_for(self._send_syslog(payload), self.timeout)
            else:
                await self._post(payload)
        except Delivery:
            raise
        except TimeoutError:
            await self.close()
            raise Delivery(f"no answer within {self.timeout:.0f}s") from None
        except (aiohttp.ClientConnectorCertificateError, ssl.SSLCertVerificationError):
            await self.close()
            raise Delivery("TLS failed (the receiver's certificate is not trusted; --ca-file?)") from None
        except ssl.SSLError as exc:
            await self.close()
            raise Delivery(f"TLS failed ({getattr(exc, 'reason', None) or type(exc).__name__})") from None
        except (aiohttp.ClientError, OSError) as exc:
            await self.close()
            raise Delivery(f"cannot reach the receiver ({type(exc).__name__})") from None
        except Exception as exc:  # anything else is this delivery's failure too: said, retried, counted
            await self.close()
            raise Delivery(f"the delivery failed ({type(exc).__name__})") from None

    async def _send_syslog(self, payload: bytes) -> None:
        e = self.target.endpoint
        if self._writer is not None and (self._writer.is_closing() or (self._reader and self._reader.at_eof())):
            await self.close()  # the receiver closed the connection: frames written now would be lost
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                e.host, e.port, ssl=self._ssl, server_hostname=e.host
            )
        self._writer.write(payload)
        await self._writer.drain()

    async def _post(self, payload: bytes) -> None:
        e = self.target.endpoint
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        headers = {"Content-Type": drains.content_type(e.scheme), "User-Agent": "zattera-drain/1", **e.headers}
        if e.basic_auth:
            user, password = e.basic_auth
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        async with self._session.post(
            e.url, data=payload, headers=headers, ssl=self._ssl or True, allow_redirects=False
        ) as resp:
            await resp.read()
            if not 200 <= resp.status < 300:
                raise Delivery(f"the receiver answered {resp.status} {resp.reason or ''}".rstrip())

    async def close(self) -> None:
        if self._writer is not None:
            writer, self._writer, self._reader = self._writer, None, None
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2.0)
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class Drainer(LeaderLoop):
    name = "drains"
    kinds = frozenset({K.LOG_DRAIN, K.ENV})

    def __init__(
        self,
        deps: LoopDeps,
        keyring: Callable[[], Keyring | None],
        *,
        settings: DrainSettings | None = None,
        tick: float = 30.0,
    ) -> None:
        super().__init__(deps, tick=tick)
        self.keyring = keyring
        self.settings = settings or DrainSettings()
        self._running: dict[str, _Running] = {}

    async def end_term(self) -> None:
        await cancel_and_wait(*(r.task for r in self._running.values()))
        self._running.clear()

    def _envs_of(self, drain: pb.LogDrain) -> list[str]:
        if drain.environment_id:
            return [drain.environment_id] if self.view.env(drain.environment_id) is not None else []
        return sorted(e.meta.id for e in self.view.envs() if e.project_id == drain.project_id)

    async def run_pass(self) -> None:
        """One task per drain; a drain whose record or environments changed starts again, a removed one's
        task stops and its consumers are deleted."""
        wanted: dict[str, tuple[pb.LogDrain, list[str], bytes]] = {}
        for d in self.view.all(K.LOG_DRAIN):
            if isinstance(d, pb.LogDrain):
                envs = self._envs_of(d)
                version = d.SerializeToString(deterministic=True) + "|".join(envs).encode()
                wanted[d.meta.id] = (d, envs, version)
        for name, running in list(self._running.items()):
            entry = wanted.get(name)
            if entry is None or entry[2] != running.version or running.task.done():
                running.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await running.task
                del self._running[name]
                kept = set(self._streams(*entry[:2])) if entry is not None else set()
                await self._delete_consumers(name, [s for s in running.streams if s not in kept])
                if entry is None and self.view.get(K.LOG_DRAIN_STATUS, name) is not None:
                    assert self.writer is not None  # removed: the status its task may have written meanwhile goes
                    await self.writer.commit(self.writer.txn("drains").delete(K.log_drain_status(name)))
        for name, (drain, envs, version) in wanted.items():
            if name not in self._running:
                task = asyncio.create_task(self._follow(drain, envs), name=f"drain-{name}")
                self._running[name] = _Running(task, version, self._streams(drain, envs))

    @staticmethod
    def _streams(drain: pb.LogDrain, envs: list[str]) -> tuple[str, ...]:
        return tuple(app_logs_stream(e) for e in envs) + ((EVENTS_STREAM,) if drain.events else ())

    async def _delete_consumers(self, name: str, streams: Sequence[str]) -> None:
        for stream in streams:
            with contextlib.suppress(Exception):
                await self.conn.js.delete_consumer(stream, drains.consumer_name(name))

    # ------------------------------------------------------------------ one drain

    def _open(self, drain: pb.LogDrain) -> _Target:
        opened = open_settings(self.keyring(), drain.sealed, drain.key_id)
        headers = json.loads(opened.get("headers") or "{}")
        url = opened["url"]
        e = drains.endpoint(url, headers)
        secrets = [url, *headers.values()]
        if e.basic_auth:
            secrets += [e.basic_auth[1]]
        return _Target(e, opened.get("ca", ""), tuple(secrets))

    def _status(self, name: str) -> pb.LogDrainStatus:
        found = self.view.get(K.LOG_DRAIN_STATUS, name)
        status = pb.LogDrainStatus()
        if isinstance(found, pb.LogDrainStatus):
            status.CopyFrom(found)
        status.meta.id = name
        return status

    async def _follow(self, drain: pb.LogDrain, envs: list[str]) -> None:
        name = drain.meta.id
        try:
            target = self._open(drain)
        except Exception as exc:
            log.error("drains: drain %s cannot be opened: %s", name, type(exc).__name__)
            status = self._status(name)
            status.last_error = "cannot open the drain's sealed settings (rotated key not held?)"
            if self._changed(status):
                await self._save(status)
            return
        restarts = Backoff(self.settings.retry_first, self.settings.retry_most)
        while True:
            try:
                await self._run_drain(drain, envs, target)
            except Deposed:
                raise
            except Exception as exc:  # a NATS fault (a stream deleted with its env): again from the consumers
                log.warning("drains: drain %s: reading the logs failed (%s); again shortly", name, type(exc).__name__)
                await self.clock.sleep(next(restarts))

    async def _source(self, drain: pb.LogDrain, src: _Source, status: pb.LogDrainStatus) -> None:
        """Bind ``src`` to the drain's durable consumer on its stream, made again from the drain's cursor (the
        greater of the status's and the consumer's ack floor) so that messages a former task held unacked
        come again at once and in order (not after the ack wait); the first time, from the drain's start."""
        durable = drains.consumer_name(drain.meta.id)
        known = next((s for s in status.sources if s.stream == src.stream), None)
        cursor = known.delivered_seq if known else 0
        try:
            info = await self.conn.js.consumer_info(src.stream, durable)
        except NotFoundError:
            info = None
        if info is not None and info.ack_floor is not None:
            cursor = max(cursor, info.ack_floor.stream_seq)
        if info is None or cursor:
            if info is not None:
                await self.conn.js.delete_consumer(src.stream, durable)
            config = ConsumerConfig(
                durable_name=durable,
                filter_subject=src.subject,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=max(self.settings.ack_wait, 2 * (self.settings.retry_most + self.settings.timeout)),
                max_ack_pending=self.settings.fetch_messages * 4,
                inactive_threshold=30 * 86400.0,
            )
            if cursor:
                config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
                config.opt_start_seq = cursor + 1
            else:
                config.deliver_policy = DeliverPolicy.BY_START_TIME
                config.opt_start_time = datetime.datetime.fromtimestamp(
                    drain.start_at.ToNanoseconds() / 1e9, datetime.UTC
                )
            await self.conn.js.add_consumer(src.stream, config)
        src.cursor = cursor
        src.dropped = known.dropped_messages if known else 0
        src.sub = await self.conn.js.pull_subscribe_bind(durable=durable, stream=src.stream)

    async def _run_drain(self, drain: pb.LogDrain, envs: list[str], target: _Target) -> None:
        status = self._status(drain.meta.id)
        streams = self._streams(drain, envs)
        for gone in [s for s in status.sources if s.stream not in streams]:  # an env deleted or left the drain
            status.sources.remove(gone)
        sources = [_Source(app_logs_stream(e), app_log_subject(e, "*"), e) for e in envs]
        if drain.events:
            sources.append(_Source(EVENTS_STREAM, EVENTS_SUBJECT_PREFIX + ">", ""))
        ready: list[_Source] = []
        for src in sources:
            try:
                await self._source(drain, src, status)
                ready.append(src)
            except NotFoundError:
                log.info("drains: drain %s: no stream %s yet", drain.meta.id, src.stream)
        sender = _Sender(target, self.settings.timeout)
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
                    await self._refresh(ready, status)
                    if self._changed(status):  # an idle drain writes nothing
                        await self._save(status)
                    saved_at = self.clock.now()
                    if await self._any_made(src for src in sources if src not in ready):
                        return  # a stream made since (a new env's first lines): the caller binds it
        finally:
            await sender.close()
            for src in ready:
                with contextlib.suppress(Exception):
                    if src.sub is not None:
                        await src.sub.unsubscribe()

    async def _any_made(self, missing: Iterable[_Source]) -> bool:
        for src in missing:
            try:
                await self.conn.js.stream_info(src.stream)
            except NotFoundError:
                continue
            return True
        return False

    def _records(self, drain: pb.LogDrain, envs: list[str], src: _Source, msg: Msg) -> list[drains.Record]:
        if src.env_id:
            return drains.records_of_batch(msg.data, env_label(self.view, src.env_id))
        try:
            event = pb.Event.FromString(msg.data)
        except DecodeError:
            return []
        ours = event.environment_id in envs if drain.environment_id else event.project_id == drain.project_id
        if not ours:
            return []
        label = env_label(self.view, event.environment_id) if event.environment_id else ""
        return [drains.record_of_event(event, label)]

    async def _ship(
        self,
        drain: pb.LogDrain,
        envs: list[str],
        target: _Target,
        sender: _Sender,
        src: _Source,
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
            found = self._records(drain, envs, src, msg)
            src.messages += 1
            src.lines += len(found)
            records.extend(found)
        step = self.settings.batch_lines
        for start in range(0, len(records), step):
            await self._deliver(drain, target, sender, records[start : start + step], msgs, status)
        if dropped:
            self._count_dropped(src, status, dropped)
        src.cursor = cursor
        status.delivered_lines += len(records)
        if records:
            stamp(status.last_delivered_at, self.clock.now())
        for msg in msgs:
            await msg.ack()
        self._write_source(src, status)

    def _count_dropped(self, src: _Source, status: pb.LogDrainStatus, dropped: int) -> None:
        """``dropped`` messages of ``src`` were removed by retention before delivery."""
        src.dropped += dropped
        status.dropped_messages += dropped
        per_message = max(1, round(src.lines / src.messages)) if src.env_id and src.messages else 1
        status.dropped_lines += dropped * per_message
        log.warning("drains: drain %s: %d message(s) of %s dropped by retention", status.meta.id, dropped, src.stream)

    def _write_source(self, src: _Source, status: pb.LogDrainStatus) -> None:
        record = next((s for s in status.sources if s.stream == src.stream), None)
        if record is None:
            record = status.sources.add(stream=src.stream)
        record.delivered_seq = src.cursor
        record.dropped_messages = src.dropped
        record.last_seq = max(record.last_seq, src.last_seq, src.cursor)
        status.lag_messages = sum(max(0, s.last_seq - s.delivered_seq) for s in status.sources)

    async def _refresh(self, sources: Sequence[_Source], status: pb.LogDrainStatus) -> None:
        """The streams' last sequences (the lag), and what retention removed past a cursor that waits."""
        for src in sources:
            try:
                info = await self.conn.js.stream_info(src.stream)
            except NotFoundError:
                continue
            src.last_seq = int(info.state.last_seq)
            first = int(info.state.first_seq)
            if src.cursor and first > src.cursor + 1:
                self._count_dropped(src, status, first - src.cursor - 1)
                src.cursor = first - 1
            self._write_source(src, status)

    async def _deliver(
        self,
        drain: pb.LogDrain,
        target: _Target,
        sender: _Sender,
        records: list[drains.Record],
        held: list[Msg],
        status: pb.LogDrainStatus,
    ) -> None:
        """Deliver ``records`` until the receiver accepts them, recording failures in ``status``."""
        payload = drains.encode(drain.scheme, records, observed_ns=time.time_ns())
        backoff = Backoff(self.settings.retry_first, self.settings.retry_most)
        while True:
            try:
                await sender.send(payload)
            except Delivery as exc:
                error = drains.scrub(str(exc), target.secrets)
            else:
                if status.failures:
                    recovered = status.failing
                    status.failing, status.failures, status.last_error = False, 0, ""
                    status.ClearField("failing_since")
                    await self._save(status)
                    if recovered:
                        await self._announce(drain, drains.RECOVERED_KIND, "delivers again", INFO)
                return
            now = self.clock.now()
            if status.failures == 0:
                stamp(status.failing_since, now)
            status.failures += 1
            status.last_error = error
            log.warning("drains: drain %s: %s (attempt %d)", drain.meta.id, error, status.failures)
            newly_failing = not status.failing and status.failures >= self.settings.failing_after
            status.failing = status.failing or newly_failing
            await self._save(status)
            if newly_failing:
                await self._announce(drain, drains.FAILING_KIND, f"is failing: {error}", ERROR)
            for msg in held:
                with contextlib.suppress(Exception):
                    await msg.in_progress()
            await self.clock.sleep(next(backoff))

    async def _announce(self, drain: pb.LogDrain, kind: str, what: str, severity: str) -> None:
        name = drain.meta.id
        message = f"log drain {name} ({drain.url_shown}) {what}"
        await self.events.publish(
            make_event(
                kind,
                message,
                clock=self.clock,
                severity=severity,
                environment_id=drain.environment_id,
                project_id=drain.project_id,
                fields={"drain": name},
            )
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
        """Write the drain's status and wait until the view shows it (the next write expects it)."""
        assert self.writer is not None
        stamp(status.meta.updated_at, self.clock.now())
        written = pb.LogDrainStatus()
        written.CopyFrom(status)
        feed = self.view.subscribe({K.LOG_DRAIN_STATUS})
        try:
            await self.writer.commit(self.writer.txn("drains").put(written))
            while self.view.get(K.LOG_DRAIN_STATUS, written.meta.id) != written:
                await asyncio.wait_for(feed.wait(), 10.0)
        finally:
            feed.close()
