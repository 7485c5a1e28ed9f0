"""An in-test builder on real NATS: answers ``RunBuildRequest`` on ``zattera.agent.<node>.build`` and
streams ``BuildEvent``\\ s on the build's events subject (the contract in shared/buildlogs.py).

By default it plays a script right after accepting; with ``hold=True`` it accepts and stays silent
until the test calls :meth:`FakeBuilder.emit` (a long or a lost build). ``refuse`` answers with an error.
``unanswered=N`` leaves the first N requests without a reply (lost with a NATS server). A build id requested
again is accepted without being run twice, as the agent's builder does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.buildlogs import ERROR_HEADER, BuildEventPublisher, cancel_build_subject, run_build_subject
from shared.connection import Connection

Script = Callable[[cpb.RunBuildRequest], Sequence[cpb.BuildEvent]]


def log_event(line: str) -> cpb.BuildEvent:
    return cpb.BuildEvent(log=pb.LogLine(line=line))


def success(digest: str = "sha256:abc123", platforms: Sequence[str] = ()) -> list[cpb.BuildEvent]:
    return [
        cpb.BuildEvent(status=pb.BUILD_STATUS_SUCCEEDED, image_digest=digest, platforms=list(platforms)),
        cpb.BuildEvent(done=True),
    ]


def instant_success(request: cpb.RunBuildRequest) -> list[cpb.BuildEvent]:
    return [cpb.BuildEvent(status=pb.BUILD_STATUS_SUCCEEDED, image_digest="sha256:abc123", done=True)]


class FakeBuilder:
    def __init__(
        self,
        conn: Connection,
        node_id: str,
        *,
        script: Script | Sequence[cpb.BuildEvent] = (),
        hold: bool = False,
        refuse: str = "",
        on_request: Callable[[cpb.RunBuildRequest], None] | None = None,
        unanswered: int = 0,
    ) -> None:
        self.conn = conn
        self.node_id = node_id
        self.script = script
        self.hold = hold
        self.refuse = refuse
        self.on_request = on_request
        self.unanswered = unanswered
        self.received = 0
        self.requests: list[cpb.RunBuildRequest] = []
        self.cancels: list[str] = []
        self._publishers: dict[str, BuildEventPublisher] = {}
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def build_ids(self) -> list[str]:
        return [r.build.meta.id for r in self.requests]

    async def start(self) -> FakeBuilder:
        nc = self.conn.nc
        self._subs = [
            await nc.subscribe(run_build_subject(self.node_id), cb=self._on_build),
            await nc.subscribe(cancel_build_subject(self.node_id), cb=self._on_cancel),
        ]
        await nc.flush()
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()

    def publisher(self, build_id: str) -> BuildEventPublisher:
        if build_id not in self._publishers:
            self._publishers[build_id] = BuildEventPublisher(self.conn, build_id, self.node_id)
        return self._publishers[build_id]

    async def emit(self, build_id: str, *events: cpb.BuildEvent) -> None:
        for event in events:
            await self.publisher(build_id).publish(event)

    async def _on_build(self, msg: Msg) -> None:
        request = cpb.RunBuildRequest.FromString(msg.data)
        self.received += 1
        if self.received <= self.unanswered:
            return
        if request.build.meta.id in self.build_ids:  # a resent request: accepted again, not run twice
            await msg.respond(b"")
            return
        self.requests.append(request)
        if self.on_request is not None:
            self.on_request(request)
        if self.refuse:
            await self.conn.nc.publish(msg.reply, b"", headers={ERROR_HEADER: self.refuse})
            return
        await msg.respond(b"")
        if self.hold:
            return
        events = self.script(request) if callable(self.script) else self.script
        task = asyncio.create_task(self.emit(request.build.meta.id, *events))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_cancel(self, msg: Msg) -> None:
        request = cpb.CancelBuildRequest.FromString(msg.data)
        self.cancels.append(request.build_id)
        await msg.respond(cpb.CancelBuildResponse(canceled=True).SerializeToString())
