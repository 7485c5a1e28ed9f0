"""Leases for singleton leader loops and the helper that runs a function only while leading.

``lease.<loop>`` holds a :class:`zattera.v1.Lease` {holder, term, acquired_at, version}. A contender acquires it
with a create (expected revision 0, or the revision of a delete marker) carrying a per-message TTL; the
holder renews it with an expected-revision update well inside the TTL, and every fenced batch of the
holder re-writes it too (:mod:`shared.txn`). The term is the revision of the acquiring write: unique per
acquisition, so two processes can never believe they lead in the same term.

The holder steps down at once when a renewal or a fenced write is refused, or when it could not renew
for longer than the TTL (the server has expired the key by then). Standbys retry every renew interval.

A holder gone from NATS is replaced sooner than its TTL: while it campaigns, each :func:`run_while_leading`
answers empty requests on its own probe subject (``Lease.probe``), and a standby that finds the lease held
asks there; "no responders" twice (the server's own answer: nobody is subscribed, the holder's connection is
closed) makes it take the lease over with a write expecting the holder's revision. A holder that is merely slow
answers late or not at all, which is a timeout, never "no responders": only the TTL ends its term.

Through a NATS server loss (docs/cluster.md): the state stream answers nothing while it elects a leader
(4–9 s, longer than the TTL), so its leaders step down. Every request of a lease is short (``REQUEST_TIMEOUT``)
and one that failed for want of an answer is asked again after ``RETRY_PAUSE``, not a renew interval later; and
a process whose own lease is still the key's last value re-acquires it at once, with an acquiring write that
expects that value's revision, instead of waiting for the new stream leader to expire it: nobody else can have
led in between, or the key's revision would have moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable, Coroutine
from dataclasses import KW_ONLY, dataclass
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js.errors import APIError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from shared.defaults import LEASE_PROBE, LEASE_RENEW, LEASE_TTL
from shared.ids import new_id
from shared.jetstream import WRONG_LAST_SEQUENCE, read_last
from shared.metrics import lease_terms, leases_held
from shared.subjects import LEASE_PROBE_PREFIX, STATE_PREFIX, STATE_STREAM
from shared.tasks import cancel_and_wait, raise_if_cancelling
from shared.version import VERSION

log = logging.getLogger(__name__)

UNCONFIRMED_RELEASE_TRIES = 3
"""Read-and-delete attempts when releasing a lease whose acquiring writes may still be landing."""

REQUEST_TIMEOUT = 1.0
"""A lease write or read not answered within this is asked again (a request sent to a stream during its
leader election is never answered, even after the election)."""
RETRY_PAUSE = 0.25
"""Pause before asking again after a request failed for want of an answer (no responders, timeout)."""
PROBE_TIMEOUT = 0.5
"""A probe of the holder not answered within this counts as an answer (a slow holder is not a gone one)."""
PROBE_GAP = 0.1
"""Pause between the two probes whose "no responders" a takeover needs (interest moving between servers)."""


def default_holder(service: str) -> str:
    return f"{service}@{socket.gethostname()}:{os.getpid()}:{new_id()[-6:]}"


@dataclass(eq=False)
class Lease:
    """One lease key; shared by the renewal task and the fenced writer through :attr:`lock`."""

    conn: Connection
    loop: str
    holder: str
    _: KW_ONLY
    ttl: float = LEASE_TTL
    renew_interval: float = LEASE_RENEW
    probe_interval: float = LEASE_PROBE

    def __post_init__(self) -> None:
        if self.ttl < 1.0:
            raise ValueError("lease ttl must be at least 1 s (the server's TTL granularity)")
        self.last_seen: bytes | None = None  # the value a refused attempt found (its holder's probe)
        self.key = K.lease(self.loop)
        self.subject = STATE_PREFIX + self.key
        self.lock = asyncio.Lock()
        self.rev = 0
        self.term = 0
        self.held = False
        self._unconfirmed = False  # an acquiring write landed, its confirming write not known to: a shutdown
        # then releases whichever of the two the key holds
        self._acquired_at = Timestamp()
        self._last_refresh = 0.0
        self._lost = asyncio.Event()
        self.lost_reason = ""
        self._js = self.conn.nc.jetstream(timeout=REQUEST_TIMEOUT)
        self.probe = f"{LEASE_PROBE_PREFIX}{new_id()}"
        self._probe_sub: Subscription | None = None  # set while this process answers on :attr:`probe`

    @property
    def _ttl_header(self) -> str:
        return f"{math.ceil(self.ttl)}s"

    def _value(self, term: int | None = None) -> bytes:
        """This lease's value in its term (``term``: another, e.g. 0 for an acquiring write)."""
        lease = pb.Lease(
            holder=self.holder,
            term=self.term if term is None else term,
            acquired_at=self._acquired_at,
            version=VERSION,
            probe=self.probe if self._probe_sub is not None else "",
        )
        return lease.SerializeToString(deterministic=True)

    async def answer_probes(self) -> None:
        """Answer on :attr:`probe` from now on (the subscription is at the server before this returns, so
        no lease value naming it is written before a standby can be answered)."""
        if self._probe_sub is not None:
            return

        async def answer(msg: Msg) -> None:
            if msg.reply:
                with contextlib.suppress(NatsError):
                    await msg.respond(b"")

        self._probe_sub = await self.conn.nc.subscribe(self.probe, cb=answer)
        await self.conn.nc.flush(timeout=2)

    @property
    def answering(self) -> bool:
        return self._probe_sub is not None

    async def stop_answering(self) -> None:
        sub, self._probe_sub = self._probe_sub, None
        if sub is not None:
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    def standby_pause(self, value: bytes | None) -> float:
        """How long a standby waits before looking again at a lease held with ``value``: the probe interval
        when its holder answers probes, else the renew interval (only its TTL can end that term)."""
        try:
            probed = value is not None and bool(pb.Lease.FromString(value).probe)
        except DecodeError:
            probed = False
        return min(self.probe_interval, self.renew_interval) if probed else self.renew_interval

    async def _holder_gone(self, value: bytes) -> bool:
        """The holder of ``value`` has no connection answering its probe subject: NATS itself said "no
        responders", twice, :data:`PROBE_GAP` apart. Any answer, a timeout or an error means it may live."""
        try:
            lease = pb.Lease.FromString(value)
        except DecodeError:
            return False
        if not lease.probe:
            return False
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(PROBE_GAP)
            try:
                await self.conn.nc.request(lease.probe, b"", timeout=PROBE_TIMEOUT)
                return False
            except NoRespondersError:
                continue
            except (NatsError, TimeoutError, OSError):
                return False
        log.info("lease %s: holder %s (term %d) is gone from NATS; taking over", self.loop, lease.holder, lease.term)
        return True

    def fence_message(self) -> tuple[str, bytes, dict[str, str]]:
        """The lease re-write that fences a batch (the caller holds :attr:`lock`)."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(self.rev), "Nats-TTL": self._ttl_header}
        return self.subject, self._value(), headers

    def refreshed(self, rev: int, sent_at: float) -> None:
        self.rev = rev
        self._last_refresh = sent_at

    def lost(self, reason: str) -> None:
        if self.held:
            log.warning("lease %s lost (term %d): %s", self.loop, self.term, reason)
        self.held = False
        self.lost_reason = reason
        self._lost.set()

    async def wait_lost(self) -> None:
        await self._lost.wait()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _publish(self, data: bytes, expect: int) -> int:
        headers = {"Nats-Expected-Last-Subject-Sequence": str(expect), "Nats-TTL": self._ttl_header}
        ack = await self._js.publish(self.subject, data, headers=headers, stream=STATE_STREAM)
        return int(ack.seq)

    async def _read_last(self) -> tuple[int, bytes | None]:
        """(revision, value) of the lease key; value None when deleted or expired (a marker) or never
        written. Raises when NATS gave no answer."""
        last = await read_last(self._js, STATE_STREAM, self.subject)
        return last.revision, last.data

    async def _last_entry(self) -> tuple[int, bytes | None]:
        """:meth:`_read_last`, reading no answer as no lease."""
        try:
            return await self._read_last()
        except (NatsError, APIError):
            return 0, None

    def _ours(self, value: bytes) -> bool:
        """The key holds this object's own last term (or its acquiring write, term 0, whose second write
        was not confirmed): no other process, nor another loop object of this one, can have led since."""
        try:
            lease = pb.Lease.FromString(value)
        except DecodeError:
            return False
        return lease.holder == self.holder and lease.term in (self.term, 0)

    async def try_acquire(self) -> bool:
        """One attempt to take the lease (free, or still holding this process's own lapsed term); True when
        this process now holds it. Raises the request's error when NATS gave no answer (worth asking again
        soon, unlike a lease held by another)."""
        async with self.lock:
            rev, value = await self._read_last()
            self.last_seen = value
            if value is not None and not self._ours(value) and not await self._holder_gone(value):
                return False
            self._acquired_at.GetCurrentTime()
            sent_at = self._now()
            self._unconfirmed = True  # until both writes are answered (a cancel may come in between)
            try:
                created = await self._publish(self._value(term=0), rev)
            except APIError as exc:
                self._unconfirmed = False
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    return False
                raise
            self.term = created
            self.rev = created
            self._last_refresh = sent_at
            sent_at = self._now()
            try:
                self.rev = await self._publish(self._value(), created)
            except APIError:
                self._unconfirmed = False
                return False
            self._unconfirmed = False
            self._last_refresh = sent_at
            self.held = True
            self._lost = asyncio.Event()
            self.lost_reason = ""
            log.info("lease %s acquired by %s (term %d)", self.loop, self.holder, self.term)
            return True

    async def renew(self) -> bool:
        """One renewal; True when it landed (False: not held, lost, or no answer — asked again soon)."""
        async with self.lock:
            if not self.held:
                return False
            sent_at = self._now()
            try:
                self.rev = await self._publish(self._value(), self.rev)
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    return await self._recognise_landed()
                self._check_expiry()
                return False
            except (NatsError, TimeoutError, OSError) as exc:
                log.debug("lease %s renewal failed: %s", self.loop, exc)
                self._check_expiry()
                return False
            self._last_refresh = sent_at
            return True

    async def _recognise_landed(self) -> bool:
        """A renewal refused because the key moved on: when its last value is exactly this term's lease, an
        earlier write of ours landed whose acknowledgement was lost (a renewal, or a fenced batch's lease
        re-write): adopt its revision and go on; otherwise the lease changed hands."""
        try:
            rev, value = await self._read_last()
        except (NatsError, APIError) as exc:
            log.debug("lease %s: could not read the key after a refused renewal: %s", self.loop, exc)
            self._check_expiry()
            return False
        if value == self._value() and rev > self.rev:
            self.rev = rev  # its refresh time stays that of the last confirmed write: the TTL is not stretched
            return True
        self.lost("renewal refused: the lease changed hands")
        return False

    def _check_expiry(self) -> None:
        if self._now() - self._last_refresh >= self.ttl - 0.2:
            self.lost("could not renew within the TTL")

    async def still_ours(self) -> bool:
        rev, value = await self._last_entry()
        if value is None or rev != self.rev:
            if value is not None:
                lease = pb.Lease.FromString(value)
                return lease.holder == self.holder and lease.term == self.term
            return False
        return True

    async def release(self) -> None:
        """Give the lease up (clean shutdown), so a standby takes over without waiting for the TTL."""
        async with self.lock:
            if self._unconfirmed:  # cancelled while confirming an acquisition
                self._unconfirmed = False
                with contextlib.suppress(Exception):
                    await self._release_unconfirmed()
                return
            if not self.held:
                return
            self.held = False
            self._lost.set()
            self.lost_reason = "released"
            with contextlib.suppress(Exception):
                await self._delete(self.rev)

    async def _release_unconfirmed(self) -> None:
        """Delete the lease if one of this process's acquiring writes holds it. Those writes were sent before the
        cancel and may still land: first let the server take everything sent (a flush), then read and delete,
        again when a write landed between the two (the delete is refused on the moved revision)."""
        await self.conn.nc.flush(timeout=2)
        for _ in range(UNCONFIRMED_RELEASE_TRIES):
            rev, value = await self._read_last()
            if value is None or not self._ours(value):
                return
            try:
                await self._delete(rev)
                return
            except APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise

    async def _delete(self, rev: int) -> None:
        await self.conn.js.publish(
            self.subject,
            b"",
            headers={"Nats-Expected-Last-Subject-Sequence": str(rev), "KV-Operation": "DEL"},
            stream=STATE_STREAM,
            timeout=2.0,
        )


@dataclass
class Leadership:
    """What a leader function receives: its term and the lease that fences its writes."""

    lease: Lease

    @property
    def term(self) -> int:
        return self.lease.term


LeaderFn = Callable[[Leadership], Coroutine[Any, Any, None]]


async def run_while_leading(
    conn: Connection,
    loop: str,
    fn: LeaderFn,
    *,
    holder: str,
    ttl: float = LEASE_TTL,
    renew_interval: float = LEASE_RENEW,
    probe_interval: float = LEASE_PROBE,
    on_term: Callable[[int], None] | None = None,
) -> None:
    """Campaign for ``lease.<loop>`` forever; run ``fn`` while holding it, cancel it on loss, re-campaign.

    Returns only when cancelled; the lease is released on the way out.
    """
    lease = Lease(conn, loop, holder, ttl=ttl, renew_interval=renew_interval, probe_interval=probe_interval)
    try:
        while True:
            if not lease.answering:
                try:
                    await lease.answer_probes()
                except (NatsError, TimeoutError, OSError) as exc:
                    log.debug("lease %s: could not answer probes yet: %s", loop, exc)
                    await asyncio.sleep(min(RETRY_PAUSE, renew_interval))
                    continue
            try:
                acquired = await lease.try_acquire()
            except (NatsError, TimeoutError, OSError, APIError) as exc:
                log.debug("lease %s: acquire attempt failed: %s", loop, exc)
                await asyncio.sleep(min(RETRY_PAUSE, renew_interval))
                continue
            raise_if_cancelling()
            if not acquired:
                await asyncio.sleep(lease.standby_pause(lease.last_seen))
                continue
            if on_term:
                on_term(lease.term)
            await _lead(lease, fn)
            await asyncio.sleep(renew_interval)
    finally:
        await asyncio.shield(lease.release())
        await asyncio.shield(lease.stop_answering())


async def _lead(lease: Lease, fn: LeaderFn) -> None:
    labels = {"loop": lease.loop}
    lease_terms.add(1, labels)
    leases_held.add(1, labels)
    try:
        await _lead_term(lease, fn)
    finally:
        leases_held.add(-1, labels)


async def _lead_term(lease: Lease, fn: LeaderFn) -> None:
    work: asyncio.Task[None] = asyncio.create_task(fn(Leadership(lease)), name=f"leader:{lease.loop}")
    lost = asyncio.create_task(lease.wait_lost())

    async def renew_forever() -> None:
        renewed = True
        while lease.held:
            await asyncio.sleep(lease.renew_interval if renewed else min(RETRY_PAUSE, lease.renew_interval))
            renewed = await lease.renew()
            raise_if_cancelling()

    renewer = asyncio.create_task(renew_forever())
    try:
        done, _ = await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        if work in done and not work.cancelled() and work.exception() is not None:
            log.error("leader loop %s crashed: %r; stepping down", lease.loop, work.exception())
            lease.lost(f"loop crashed: {work.exception()!r}")
            await lease.release()
    finally:
        await cancel_and_wait(work, lost, renewer)
    if lease.held:
        # fn returned on its own while still leading: hand over.
        await lease.release()
