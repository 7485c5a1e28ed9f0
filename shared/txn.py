"""Fenced, atomic writes to ``zattera-state``: every decision is one batch that lands whole or not at all.

A :class:`Txn` is a list of puts and deletes, each carrying the revision its decision was based on
(captured from the view when the op is added; 0 = create). :class:`Writer` commits it as ONE JetStream
atomic batch (headers ``Nats-Batch-Id`` / ``Nats-Batch-Sequence`` / ``Nats-Batch-Commit``), every
message with ``Nats-Expected-Last-Subject-Sequence``. A leader loop's writer also re-writes its
``lease.<loop>`` key in the same batch, expecting the revision of its own last lease write: a deposed
leader's batch is refused by the server, whole.

On success the writer applies the writes to its view before returning (read-your-writes). On a conflict
nothing was written; :class:`Conflict` is raised and the caller refreshes and re-decides (never a blind
retry: :func:`shared.retry.commit_with_retry` is that loop). When the outcome is unknown (the commit reply
was lost), the writer first waits until its view has caught up with the stream, then raises
:class:`CommitUnknown`, so the caller's next decision sees whatever did land. A single write (no lease: the
CLI's, the console's) is first sent again, with the same ``Nats-Msg-Id``, until the stream answers or the
commit timeout has passed: through a lost leader's election, the first send after it is answered.

Throughput: an R1 file-backed atomic batch costs a disk flush on the server (~5–15 ms here) whatever
its size, so :meth:`Writer.commit_many` packs many transactions into few batches (up to 1,000
messages) and isolates conflicting ones by bisection; concurrent :meth:`Writer.commit` calls are group
committed the same way. Atomicity stays per transaction: a transaction's messages are never split
across batches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NoStreamResponseError

from shared import keys as K
from shared.connection import Connection
from shared.defaults import MAX_BATCH, TOMBSTONE_TTL
from shared.errors import ZatteraError
from shared.ids import message_id
from shared.jetstream import WRONG_LAST_SEQUENCE
from shared.metrics import commit_conflicts, decisions, writer_label
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.tasks import raise_if_cancelling
from shared.telemetry import inject, span

if TYPE_CHECKING:
    from shared.lease import Lease

log = logging.getLogger(__name__)


class TxnError(ZatteraError):
    pass


class Conflict(TxnError):
    """A key changed since the decision (or the lease was lost): nothing of the transaction was written."""

    def __init__(self, message: str, *, deposed: bool = False) -> None:
        super().__init__(message)
        self.deposed = deposed


class Deposed(Conflict):
    """The writer's lease is no longer ours: the server refused the write; stop acting as leader."""

    def __init__(self, message: str) -> None:
        super().__init__(message, deposed=True)


class CommitUnknown(TxnError):
    """The commit reply was lost; the view has since caught up, so re-deciding is safe."""


ATTEMPT_TIMEOUT = 2.0
"""How long one send of a single write waits for the stream's answer before it is sent again (within the
commit timeout): a write that reached no leader is never answered, and only a send after the election is."""
RESEND_PAUSE = 0.25
"""The pause before a write refused for want of a leader ("no responders", 503) is sent again."""
UNAVAILABLE = 503
"""JetStream's "temporarily unavailable" (no leader yet), and the relay's answer when no leader answered it."""


@dataclass(slots=True)
class Op:
    key: str
    expect: int
    msg: Message | None  # None = delete

    @property
    def is_delete(self) -> bool:
        return self.msg is None


@dataclass
class Txn:
    """Puts and deletes decided against ``view``; expectations are captured when each op is added."""

    view: StateView
    ops: list[Op] = field(default_factory=list)
    label: str = ""

    def put(self, msg: Message, *, key: str | None = None, expect: int | None = None) -> Txn:
        k = key or K.key_of(msg)
        self._add(Op(k, self.view.rev(k) if expect is None else expect, msg))
        return self

    def create(self, msg: Message, *, key: str | None = None) -> Txn:
        """Write a key that must not exist yet (expects revision 0)."""
        return self.put(msg, key=key, expect=0)

    def delete(self, key: str, *, expect: int | None = None) -> Txn:
        self._add(Op(key, self.view.rev(key) if expect is None else expect, None))
        return self

    def extend(
        self, *, creates: Iterable[Message] = (), puts: Iterable[Message] = (), deletes: Iterable[str] = ()
    ) -> Txn:
        """Add a decision's creates, puts and deletes (expectations from the view, as for single ops)."""
        for msg in creates:
            self.create(msg)
        for msg in puts:
            self.put(msg)
        for key in deletes:
            self.delete(key)
        return self

    def _add(self, op: Op) -> None:
        K.parse(op.key)  # BadKey: a key that is no subject would be written elsewhere, or break the batch
        for i, existing in enumerate(self.ops):
            if existing.key == op.key:
                # A later op on the same key supersedes the earlier one but keeps its expectation.
                self.ops[i] = Op(op.key, existing.expect, op.msg)
                return
        self.ops.append(op)

    @property
    def keys(self) -> list[str]:
        return [op.key for op in self.ops]

    def __len__(self) -> int:
        return len(self.ops)

    def __bool__(self) -> bool:
        return bool(self.ops)


@dataclass
class _Pending:
    txn: Txn
    future: asyncio.Future[None]


class Writer:
    """Commits transactions to the state bucket, fenced by ``lease`` when given."""

    def __init__(
        self,
        conn: Connection,
        view: StateView,
        *,
        lease: Lease | None = None,
        max_batch: int = MAX_BATCH,
        tombstone_ttl: float = TOMBSTONE_TTL,
        commit_timeout: float = 10.0,
    ) -> None:
        self._conn = conn
        self._view = view
        self._lease = lease
        self._max_batch = max_batch
        self._tombstone_ttl = f"{max(1, math.ceil(tombstone_ttl))}s"
        self._timeout = commit_timeout
        self._queue: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self._labels = writer_label(lease.loop if lease is not None else "")
        self.extra_headers: dict[str, str] = {}
        """Headers sent with every write (a secured CLI's audit claims, which the relay reads and strips)."""
        self.resent = 0
        """How many times a single write was sent again for want of an answer (:meth:`_publish_single`)."""

    @property
    def view(self) -> StateView:
        return self._view

    def txn(self, label: str = "") -> Txn:
        return Txn(self._view, label=label)

    # ------------------------------------------------------------------ public API

    async def commit(self, txn: Txn) -> None:
        """Commit one transaction atomically. Concurrent callers are group committed."""
        if not txn:
            return
        self._check_size(txn)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(txn, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_queue())
        try:
            await fut
        except Conflict:
            await self._view.refresh_snapshot()  # the caller re-decides on what won
            raise

    async def commit_many(self, txns: Sequence[Txn]) -> list[TxnError | None]:
        """Commit many independent transactions in few batches; one result per transaction (None = ok).

        Raises :class:`Deposed` when the lease is lost (nothing further is attempted).
        """
        for txn in txns:
            self._check_size(txn)
        results: list[TxnError | None] = [None] * len(txns)
        work = [(i, t) for i, t in enumerate(txns) if t]
        for group in self._groups(work):
            await self._commit_group(group, results)
        raise_if_cancelling()
        return results

    # ------------------------------------------------------------------ grouping

    def _check_size(self, txn: Txn) -> None:
        limit = self._max_batch - (1 if self._lease else 0)
        if len(txn) > limit:
            raise TxnError(f"transaction of {len(txn)} writes exceeds the batch limit of {limit}")

    def _groups(self, work: list[tuple[int, Txn]]) -> list[list[tuple[int, Txn]]]:
        """Pack transactions in order into groups that fit one batch and touch each key once."""
        limit = self._max_batch - (1 if self._lease else 0)
        groups: list[list[tuple[int, Txn]]] = []
        current: list[tuple[int, Txn]] = []
        size = 0
        seen: set[str] = set()
        for item in work:
            txn = item[1]
            if current and (size + len(txn) > limit or any(k in seen for k in txn.keys)):
                groups.append(current)
                current, size, seen = [], 0, set()
            current.append(item)
            size += len(txn)
            seen.update(txn.keys)
        if current:
            groups.append(current)
        return groups

    async def _commit_group(self, group: list[tuple[int, Txn]], results: list[TxnError | None]) -> None:
        try:
            await self._commit_ops([op for _, t in group for op in t.ops], label=group[0][1].label)
        except Deposed:
            commit_conflicts.add(len(group), self._labels)
            raise
        except Conflict as exc:
            if len(group) == 1:
                commit_conflicts.add(1, self._labels)
                results[group[0][0]] = exc
                return
            mid = len(group) // 2
            await self._commit_group(group[:mid], results)
            await self._commit_group(group[mid:], results)
        except CommitUnknown as exc:
            for i, _ in group:
                results[i] = exc
        else:
            decisions.add(len(group), self._labels)

    async def _flush_queue(self) -> None:
        while self._queue:
            pending, self._queue = self._queue, []
            txns = [p.txn for p in pending]
            try:
                results = await self.commit_many(txns)
            except Exception as exc:
                for p in pending:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, result in zip(pending, results, strict=True):
                if p.future.done():
                    continue
                if result is None:
                    p.future.set_result(None)
                else:
                    p.future.set_exception(result)

    # ------------------------------------------------------------------ the batch itself

    async def _commit_ops(self, ops: list[Op], *, label: str = "") -> None:
        if self._lease is None:
            if len(ops) == 1:
                await self._publish_single(ops[0])
                return
            await self._publish_batch(ops, fence=None)
            return
        async with self._lease.lock:
            if not self._lease.held:
                raise Deposed(f"lease {self._lease.loop} is not held")
            await self._publish_batch(ops, fence=self._lease)

    def _message(self, op: Op, trace: dict[str, str]) -> tuple[str, bytes, dict[str, str]]:
        """``trace``: the current trace context's headers (:func:`inject`), taken once for a whole batch."""
        headers = {**self.extra_headers, "Nats-Expected-Last-Subject-Sequence": str(op.expect), **trace}
        if op.msg is None:
            headers["KV-Operation"] = "DEL"
            headers["Nats-TTL"] = self._tombstone_ttl
            return STATE_PREFIX + op.key, b"", headers
        return STATE_PREFIX + op.key, K.encode(op.msg), headers

    async def _publish_single(self, op: Op) -> None:
        """Publish one write, sent again until the stream answers or the commit timeout has passed: a write sent
        while the state stream elects a leader (its leader's machine lost) is answered by nobody — "no
        responders", a 503, or no reply at all while the servers still route to the lost leader — and the first
        one sent after the election is answered. Each attempt waits :data:`ATTEMPT_TIMEOUT`, not the whole
        timeout. A resend carries the same ``Nats-Msg-Id``, so the stream stores the write once (a resend of a
        write that was stored is answered with the first one's sequence, as a duplicate); the expected revision
        fences it too."""
        subject, data, headers = self._message(op, inject())
        headers["Nats-Msg-Id"] = message_id()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        with span("state.write", key=op.key):
            while True:
                remaining = deadline - loop.time()
                try:
                    ack = await self._conn.js.publish(
                        subject,
                        data,
                        timeout=max(0.05, min(ATTEMPT_TIMEOUT, remaining)),
                        headers=headers,
                        stream=STATE_STREAM,
                    )
                    break
                except APIError as exc:
                    if exc.err_code == WRONG_LAST_SEQUENCE:
                        raise Conflict(f"{op.key}: {exc.description}") from exc
                    if exc.code != UNAVAILABLE or remaining <= RESEND_PAUSE:
                        raise TxnError(f"write of {op.key} refused: {exc.description}") from exc
                except (NatsTimeoutError, TimeoutError, NoStreamResponseError) as exc:
                    if remaining <= ATTEMPT_TIMEOUT:
                        await self._catch_up()
                        raise CommitUnknown(f"no reply for the write of {op.key}") from exc
                self.resent += 1
                await asyncio.sleep(min(RESEND_PAUSE, max(0.0, deadline - loop.time())))
        self._view.apply_local(op.key, ack.seq, op.msg, headers.get("traceparent", ""))

    async def _publish_batch(self, ops: list[Op], *, fence: Lease | None) -> None:
        """Publish the batch, sent again (a new batch id, the same expected revisions) while nobody takes it —
        "no responders" or a 503 (no stream leader, no relay yet): nothing of it was stored — until the commit
        timeout. A commit that got no answer at all is unknown (:class:`CommitUnknown`), never sent again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        with span("state.batch", writes=len(ops), fenced=fence is not None) as current:
            while True:
                trace = inject()
                messages = [self._message(op, trace) for op in ops]
                if fence is not None:
                    messages.append(fence.fence_message())
                sent_at = loop.time()
                ack = await self._send_batch(messages, max(0.05, deadline - sent_at))
                error = ack.get("error") if ack is not None else None
                taken = ack is not None and not (isinstance(error, dict) and error.get("code") == UNAVAILABLE)
                if taken or deadline - loop.time() <= RESEND_PAUSE:
                    break
                self.resent += 1
                await asyncio.sleep(RESEND_PAUSE)
            if ack is None:
                raise TxnError(f"batch of {len(ops)} writes: nobody took it (no stream leader or relay answered)")
            if error:
                current.set_attribute("error", str(error.get("description")))
                if error.get("err_code") == WRONG_LAST_SEQUENCE:
                    if fence is not None and not await fence.still_ours():
                        fence.lost("a fenced write found the lease taken")
                        raise Deposed(f"lease {fence.loop} lost: {error.get('description')}")
                    raise Conflict(f"batch of {len(ops)} writes: {error.get('description')}")
                raise TxnError(f"batch refused: {error.get('description')} (code {error.get('err_code')})")
        last = int(ack["seq"])
        first = last - len(messages) + 1
        if fence is not None:
            fence.refreshed(last, sent_at)
        for i, op in enumerate(ops):
            self._view.apply_local(op.key, first + i, op.msg, messages[i][2].get("traceparent", ""))

    async def _send_batch(
        self, messages: list[tuple[str, bytes, dict[str, str]]], timeout: float
    ) -> dict[str, Any] | None:
        """Send one atomic batch; the stream's (or the relay's) answer, or None when nobody took the commit."""
        nc = self._conn.nc
        batch_id = message_id()
        count = len(messages)
        for seq, (subject, data, headers) in enumerate(messages, start=1):
            headers["Nats-Batch-Id"] = batch_id
            headers["Nats-Batch-Sequence"] = str(seq)
            if seq < count:
                await nc.publish(subject, data, headers=headers)
        subject, data, headers = messages[-1]
        headers["Nats-Batch-Commit"] = "1"
        try:
            reply = await nc.request(subject, data, headers=headers, timeout=timeout)
        except NoRespondersError:
            return None
        except (NatsTimeoutError, TimeoutError) as exc:
            await self._catch_up()
            raise CommitUnknown(f"no reply for batch {batch_id} ({count} messages)") from exc
        answer: dict[str, Any] = json.loads(reply.data or b"{}")
        return answer

    async def _catch_up(self) -> None:
        """After an unknown outcome, wait until the view has seen everything the stream holds."""
        try:
            info = await self._conn.js.stream_info(STATE_STREAM)
        except Exception:
            await self._view.force_resync()
            return
        target = info.state.last_seq
        for _ in range(200):
            if self._view.last_revision >= target:
                return
            await asyncio.sleep(0.01)
        await self._view.force_resync()
