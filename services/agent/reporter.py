"""Observed reports: the agent's only writes to assignments, ``observed.<node>.<assignment_id>``.

Supervisors hand in the latest report per assignment; the reporter coalesces them (latest wins), applies
the merge rule (``shared.state.store.merge_observed``: a RUNNING report never downgrades HEALTHY/UNHEALTHY of the
same container), skips reports equal to what is stored (``updated_at`` aside), and commits each pass in
few batches. A refused or unknown write is re-queued (unless a newer report replaced it) and re-tried
after ``retry_delay``, against the view's fresh revision. ``forget`` deletes the key of an assignment
that vanished.
"""

from __future__ import annotations

import asyncio
import logging

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.state.feed import StateView
from shared.state.tables import merge_observed
from shared.txn import Txn, Writer

log = logging.getLogger(__name__)

Report = pb.AssignmentObserved | None
"""A report to write, or None: delete the key."""


def same_report(a: pb.AssignmentObserved, b: pb.AssignmentObserved) -> bool:
    """Equal apart from ``updated_at`` (re-writing only a newer timestamp is noise)."""
    left, right = pb.AssignmentObserved(), pb.AssignmentObserved()
    left.CopyFrom(a)
    right.CopyFrom(b)
    left.ClearField("updated_at")
    right.ClearField("updated_at")
    return left == right


class ObservedReporter:
    def __init__(self, writer: Writer, node_id: str, *, retry_delay: float = 0.5) -> None:
        self._writer = writer
        self._view: StateView = writer.view
        self.node_id = node_id
        self._retry_delay = retry_delay
        self._pending: dict[str, Report] = {}
        self._signal = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def report(self, assignment_id: str, observed: pb.AssignmentObserved) -> None:
        self._queue(assignment_id, observed)

    def forget(self, assignment_id: str) -> None:
        """Delete the assignment's observed key (its assignment is gone)."""
        self._queue(assignment_id, None)

    def _queue(self, assignment_id: str, report: Report) -> None:
        self._pending[assignment_id] = report
        self._idle.clear()
        self._signal.set()

    async def wait_idle(self) -> None:
        """Until every queued report has been written or found unnecessary."""
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            await self._signal.wait()
            self._signal.clear()
            if await self.flush():
                await asyncio.sleep(self._retry_delay)
                self._signal.set()
            elif not self._pending:
                self._idle.set()

    async def flush(self) -> bool:
        """Write what is queued; True when something must be re-tried."""
        batch, self._pending = self._pending, {}
        txns: list[Txn] = []
        written: list[tuple[str, Report]] = []
        for assignment_id, report in batch.items():
            txn = self._txn(assignment_id, report)
            if txn is not None:
                txns.append(txn)
                written.append((assignment_id, report))
        if not txns:
            return False
        results: list[Exception | None]
        try:
            results = list(await self._writer.commit_many(txns))
        except Exception as exc:
            log.warning("observed reports not written (%s); re-trying", exc)
            results = [exc] * len(txns)
        retry = False
        for (assignment_id, report), result in zip(written, results, strict=True):
            if result is None:
                continue
            log.info("observed report for %s refused (%s); re-trying", assignment_id, result)
            self._pending.setdefault(assignment_id, report)
            retry = True
        return retry

    def _txn(self, assignment_id: str, report: Report) -> Txn | None:
        key = K.observed(self.node_id, assignment_id)
        if report is None:
            return self._writer.txn("observed").delete(key) if self._view.rev(key) else None
        stored = self._view.observed(self.node_id, assignment_id)
        merged = merge_observed(stored, report)
        if stored is not None and same_report(stored, merged):
            return None
        return self._writer.txn("observed").put(merged, key=key)
