"""A stand-in for node agents: reports observed state on NATS as agents do, instantly.

It watches the state bucket with its own view and, for every assignment on a node whose agent is alive,
writes ``observed.<node>.<assignment_id>`` (the agent's key) when the state it should report changes:

* desired RUN: the state the gates say — ``green_state`` for replicas created by a deployment (tagged),
  ``other_state`` for untagged ones (seeded or scheduler-placed); ``overrides`` per assignment id win.
  None = report nothing (a container stuck before its first report).
* desired STOP: STOPPED when ``report_stopped`` (the reference agent reports STOPPED for stopped ones).

Assignments that vanish are simply forgotten (the agent removes their containers). ``dead_nodes`` are
nodes whose agent is gone: nothing is reported for them. Change gates, then call :meth:`poke`.
Every report is recorded in ``reports`` with its acknowledgement time (``time.perf_counter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from shared.state.changes import ChangeFeed
from shared.state.feed import StateView
from shared.txn import Writer

HEALTHY = pb.INSTANCE_STATE_HEALTHY
RUNNING = pb.INSTANCE_STATE_RUNNING
FAILED = pb.INSTANCE_STATE_FAILED
STOPPED = pb.INSTANCE_STATE_STOPPED


@dataclass(frozen=True, slots=True)
class Report:
    at: float
    assignment_id: str
    state: int


class AgentSim:
    def __init__(self, conn: Connection, *, name: str = "agent-sim", view: StateView | None = None) -> None:
        """``view``: one node's own (filtered, or pulled on a secured cluster) instead of the whole bucket."""
        self.view = view or StateView(conn, name=name)
        self.writer = Writer(conn, self.view)
        self.green_state: int | None = HEALTHY
        self.other_state: int | None = HEALTHY
        self.report_stopped = True
        self.overrides: dict[str, int | None] = {}
        self.dead_nodes: set[str] = set()
        self.reports: list[Report] = []
        self._reported: dict[str, int] = {}
        self._containers: dict[str, int] = {}
        self._feed: ChangeFeed | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> AgentSim:
        await self.view.start()
        self._feed = self.view.subscribe({K.ASSIGNMENT, K.NODE})
        self._task = asyncio.create_task(self._run(self._feed))
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._feed is not None:
            self._feed.close()
        await self.view.stop()

    def poke(self) -> None:
        """Re-evaluate now (after changing a gate)."""
        if self._feed is not None:
            self._feed.poke()

    def target_state(self, a: pb.Assignment) -> int | None:
        if a.desired != pb.ASSIGNMENT_DESIRED_RUN:
            return STOPPED if self.report_stopped else None
        if a.meta.id in self.overrides:
            return self.overrides[a.meta.id]
        return self.green_state if a.deployment_id else self.other_state

    async def _run(self, feed: ChangeFeed) -> None:
        while True:
            await self.report_once()
            await feed.wait()

    async def report_once(self) -> None:
        txns = []
        pending: list[tuple[str, int]] = []
        for a in self.view.assignments():
            if a.node_id in self.dead_nodes:
                continue
            state = self.target_state(a)
            if state is None or self._reported.get(a.meta.id) == state:
                continue
            if self._reported.get(a.meta.id) == STOPPED:
                self._containers[a.meta.id] = self._containers.get(a.meta.id, 0) + 1  # restarted: a new container
            container = f"c-{a.meta.id}-{self._containers.get(a.meta.id, 0)}"
            observed = pb.AssignmentObserved(state=state, container_id=container)  # type: ignore[arg-type]
            observed.updated_at.GetCurrentTime()
            txns.append(self.writer.txn("observed").put(observed, key=K.observed(a.node_id, a.meta.id)))
            pending.append((a.meta.id, state))
        if not txns:
            return
        results = await self.writer.commit_many(txns)
        at = time.perf_counter()
        for (aid, state), result in zip(pending, results, strict=True):
            if result is None:
                self._reported[aid] = state
                self.reports.append(Report(at, aid, state))
