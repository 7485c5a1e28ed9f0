"""The build dispatcher's event followers: the RunBuild requests to builders, and for every RUNNING build
this leader follows, its durable events (stream ``ZATTERA_BUILD_EVENTS``) copied to the build log and
turned into the build's outcome, written once under the term's lease.

A new leader replays the events of every RUNNING build, so an outcome reported during the failover is not
lost; a replayed event counts for the builder-lost timeout at its own stream timestamp
(:func:`~services.builds.planning.event_time`). A builder still streaming for a build that already ended is
told to stop on ``zattera.agent.<node>.build.cancel``. What to do is decided in planning.py; this module
only carries it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.builds.planning import (
    RUNNING,
    BuildDispatcherConfig,
    EventRoute,
    Followed,
    StreamProgress,
    Verdict,
    apply_event,
    checkpoint_due,
    copy_build,
    event_time,
    finished_build,
    plan_following,
    resend_on_resume,
    route_unfollowed_event,
    run_request,
)
from shared.buildlogs import (
    ERROR_HEADER,
    append_log_lines,
    build_id_of_events_subject,
    cancel_build_subject,
    close_log,
    last_copied_event_seq,
    run_build_subject,
    sender_of_events_subject,
)
from shared.clock import Clock, from_timestamp, to_timestamp
from shared.connection import Connection
from shared.retry import Attempt, RetriesExhausted, commit_with_retry, decide_again
from shared.state.feed import CONSUMER_HEARTBEAT, StateView, guard_ordered_consumer
from shared.subjects import BUILD_EVENTS_STREAM, build_events_subject
from shared.tasks import cancel_and_wait
from shared.telemetry import inject, span
from shared.txn import Deposed, Writer

log = logging.getLogger(__name__)

NO_RESPONDERS_GRACE = 3.0
"""How long a RunBuild request nobody received is sent again (a builder reconnecting to another server)."""
NO_RESPONDERS_PAUSE = 0.25
REQUEST_ATTEMPT = 1.0
"""A builder accepts a RunBuild at once; an attempt unanswered this long is sent again (its NATS server lost
with the request or the reply in flight). Builders accept a build id they run or ran again without starting
it twice, so a resent request is safe."""


def stored_at(msg: Msg) -> float:
    """When JetStream stored the message (its stream timestamp, from the delivery metadata), in epoch seconds."""
    return msg.metadata.timestamp.timestamp()


@dataclass(frozen=True, slots=True)
class _Conclude:
    verdict: Verdict
    stop_builder: bool = False


_Item = tuple[int, cpb.BuildEvent] | _Conclude


@dataclass(eq=False)
class _Follower:
    """One RUNNING build this leader follows: its events queue and what they told."""

    build_id: str
    node_id: str
    resumed: bool
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    progress: StreamProgress = field(default_factory=StreamProgress)
    last_event_at: float = 0.0
    checkpointed_at: float = 0.0
    handled_seq: int = 0
    logged_seq: int = 0
    concluding: bool = False
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class BuildFollowers:
    """The followers of one leadership term (:meth:`start` at its beginning, :meth:`stop` at its end)."""

    conn: Connection
    view: StateView
    clock: Clock
    config: BuildDispatcherConfig

    def __post_init__(self) -> None:
        self._writer: Writer | None = None
        self._followers: dict[str, _Follower] = {}
        self._told_to_stop: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._events_sub: Any = None
        self._replay_until = 0

    # ------------------------------------------------------------------ the term

    async def start(self, writer: Writer) -> None:
        """Resume every RUNNING build, then replay the durable events (what a previous leader missed)."""
        self._writer = writer
        self._told_to_stop.clear()
        info = await self.conn.js.stream_info(BUILD_EVENTS_STREAM)
        self._replay_until = info.state.last_seq
        for build in self.view.builds():
            if build.status == RUNNING and build.node_id:
                self._follow(build, resumed=True)
        self._events_sub = await self.conn.js.subscribe(
            build_events_subject("*"),
            stream=BUILD_EVENTS_STREAM,
            ordered_consumer=True,
            cb=self._on_event_msg,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            pending_msgs_limit=1_000_000,
            idle_heartbeat=CONSUMER_HEARTBEAT,  # a consumer lost with a NATS server is re-created within ~2 s
        )
        guard_ordered_consumer(self._events_sub, None)

    async def stop(self) -> None:
        if self._events_sub is not None:
            with contextlib.suppress(Exception):
                await self._events_sub.unsubscribe()
            self._events_sub = None
        tasks = [f.task for f in self._followers.values() if f.task] + list(self._tasks)
        self._followers.clear()
        await cancel_and_wait(*tasks)
        self._tasks.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ what the loop asks

    def last_event_seen(self) -> dict[str, float]:
        """When each followed build's newest event counted (for the builder-lost timeout)."""
        return {f.build_id: f.last_event_at for f in self._followers.values()}

    def reconcile(self) -> None:
        """Follow every RUNNING build; let go of builds that ended elsewhere (canceled by an operator)."""
        followed = {i: Followed(f.node_id, f.concluding) for i, f in self._followers.items()}
        plan = plan_following(self.view.builds(), self.view.build, followed)
        ended = dict(plan.wrap_up)
        for build_id in plan.let_go:
            follower = self._followers.pop(build_id)
            if follower.task:
                follower.task.cancel()
            if build_id in ended:
                self._spawn(self._wrap_up(follower, ended[build_id], stop_builder=True))
        for build_id in plan.follow:
            build = self.view.build(build_id)
            if build is not None:
                self._follow(build, resumed=True)

    def dispatched(self, claimed: pb.Build, now: float, trace: dict[str, str] | None) -> None:
        """A claim made at ``now`` landed: follow the build from then and send its builder the RunBuild."""
        follower = self._follow(claimed, resumed=False)
        follower.last_event_at = now
        follower.checkpointed_at = now
        self._spawn(self._send(claimed, trace))

    def conclude(self, build_id: str, verdict: Verdict, *, stop_builder: bool = False) -> None:
        follower = self._followers.get(build_id)
        if follower is None or follower.concluding:
            return
        follower.concluding = True
        follower.queue.put_nowait(_Conclude(verdict, stop_builder))

    # ------------------------------------------------------------------ contacting builders

    async def _send(self, build: pb.Build, trace: dict[str, str] | None = None) -> None:
        request = run_request(build, self.config, self.view.app(build.app_id))
        try:
            with span("builds.dispatch", headers=trace, build_id=build.meta.id, node_id=build.node_id):
                reply = await self._request_build(build.node_id, request.SerializeToString(deterministic=True))
        except (NatsError, TimeoutError) as exc:
            self.conclude(build.meta.id, Verdict(pb.BUILD_STATUS_FAILED, f"dispatch: {exc}"))
            return
        refused = (reply.headers or {}).get(ERROR_HEADER)
        if refused:
            self.conclude(build.meta.id, Verdict(pb.BUILD_STATUS_FAILED, f"build stream: {refused}"))

    async def _request_build(self, node_id: str, data: bytes) -> Msg:
        """The builder's reply. "No responders" means nobody received the request — the builder is
        reconnecting after its NATS server was lost — so it is sent again for ``NO_RESPONDERS_GRACE``; an
        attempt with no reply (the request or the reply lost with a server) is sent again every
        ``REQUEST_ATTEMPT`` until ``request_timeout`` has passed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            unanswered_for = loop.time() - started
            try:
                return await self.conn.nc.request(
                    run_build_subject(node_id),
                    data,
                    timeout=max(0.1, min(REQUEST_ATTEMPT, self.config.request_timeout - unanswered_for)),
                    headers=inject(),
                )
            except NoRespondersError:
                if loop.time() - started >= NO_RESPONDERS_GRACE:
                    raise
                await asyncio.sleep(NO_RESPONDERS_PAUSE)
            except NatsTimeoutError:
                if loop.time() - started >= self.config.request_timeout:
                    raise

    async def _tell_builder_to_stop(self, node_id: str, build_id: str) -> None:
        try:
            await self.conn.nc.request(
                cancel_build_subject(node_id),
                cpb.CancelBuildRequest(build_id=build_id).SerializeToString(),
                timeout=self.config.request_timeout,
            )
        except (NatsError, TimeoutError) as exc:
            log.info("build %s: could not tell builder %s to stop: %s", build_id, node_id, exc)

    # ------------------------------------------------------------------ following events

    def _follow(self, build: pb.Build, *, resumed: bool) -> _Follower:
        follower = _Follower(build.meta.id, build.node_id, resumed, checkpointed_at=from_timestamp(build.last_event_at))
        self._followers[build.meta.id] = follower
        follower.task = asyncio.create_task(self._run_follower(follower), name=f"build:{build.meta.id}")
        if resumed and resend_on_resume(build, self.clock.now()):
            self._spawn(self._resend(build))
        return follower

    async def _resend(self, build: pb.Build) -> None:
        """The RunBuild of a build claimed moments ago, perhaps never sent (see ``CLAIM_IN_FLIGHT``); a
        builder that cannot be reached now is left to the lost timeout, as for any resumed build."""
        request = run_request(build, self.config).SerializeToString(deterministic=True)
        try:
            reply = await self._request_build(build.node_id, request)
        except (NatsError, TimeoutError) as exc:
            log.info("build %s: RunBuild sent again on resume got no answer: %s", build.meta.id, exc)
            return
        refused = (reply.headers or {}).get(ERROR_HEADER)
        if refused:
            self.conclude(build.meta.id, Verdict(pb.BUILD_STATUS_FAILED, f"build stream: {refused}"))

    async def _on_event_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        build_id = build_id_of_events_subject(msg.subject)
        try:
            event = cpb.BuildEvent.FromString(msg.data)
        except DecodeError as exc:
            log.warning("undecodable build event on %s (seq %d): %s", msg.subject, seq, exc)
            return
        live = seq > self._replay_until
        sender = sender_of_events_subject(msg.subject)
        follower = self._followers.get(build_id)
        assigned = follower.node_id if follower is not None else getattr(self.view.build(build_id), "node_id", "")
        if sender != assigned:
            # Only the builder the build was assigned to speaks for it (its node id is permission-enforced).
            log.warning("build %s: ignored an event from node %r (assigned to %r)", build_id, sender, assigned)
            return
        if follower is None:
            build = self.view.build(build_id)
            route = route_unfollowed_event(build, event, live=live)
            if route is EventRoute.STOP_BUILDER and build is not None:
                self._stop_stray_builder(build)
            if route is not EventRoute.FOLLOW or build is None:
                return
            follower = self._follow(build, resumed=True)
        at = event_time(live=live, stored_at=stored_at(msg), now=self.clock.now())
        follower.last_event_at = max(follower.last_event_at, at)
        follower.queue.put_nowait((seq, event))

    def _stop_stray_builder(self, build: pb.Build) -> None:
        """A builder still streams for a build that already ended: tell it once per term to stop."""
        if build.meta.id in self._told_to_stop or not build.node_id:
            return
        self._told_to_stop.add(build.meta.id)
        self._spawn(self._tell_builder_to_stop(build.node_id, build.meta.id))

    async def _run_follower(self, follower: _Follower) -> None:
        try:
            if follower.resumed:
                follower.logged_seq = await last_copied_event_seq(self.conn, follower.build_id)
            while True:
                item = await follower.queue.get()
                if isinstance(item, _Conclude):
                    await self._finish(follower, item.verdict, stop_builder=item.stop_builder)
                    return
                seq, event = item
                if seq <= follower.handled_seq:
                    continue
                follower.handled_seq = seq
                if event.log.line and seq > follower.logged_seq:
                    await append_log_lines(self.conn, follower.build_id, [(seq, event.log.line)])
                    follower.logged_seq = seq
                verdict = apply_event(follower.progress, event)
                if verdict is not None and not follower.concluding:
                    follower.concluding = True
                    await self._finish(follower, verdict, stop_builder=False)
                    return
                if checkpoint_due(follower.last_event_at, follower.checkpointed_at, self.config.checkpoint_interval):
                    await self._checkpoint(follower)
        except Deposed:
            return

    async def _checkpoint(self, follower: _Follower) -> None:
        at = follower.last_event_at

        def change(build: pb.Build) -> pb.Build:
            b = copy_build(build)
            b.last_event_at.CopyFrom(to_timestamp(at))
            return b

        if await self._record(follower, change):
            follower.checkpointed_at = at

    async def _finish(self, follower: _Follower, verdict: Verdict, *, stop_builder: bool) -> None:
        now = self.clock.now()
        recorded = await self._record(follower, lambda b: finished_build(b, verdict, self.config, now))
        if recorded:
            if verdict.status == pb.BUILD_STATUS_SUCCEEDED:
                log.info("build %s succeeded on %s", follower.build_id, follower.node_id)
            else:
                log.info("build %s failed on %s: %s", follower.build_id, follower.node_id, verdict.error)
        if self._followers.get(follower.build_id) is follower:
            del self._followers[follower.build_id]
        build = self.view.build(follower.build_id)
        await self._wrap_up(follower, build.status if build else verdict.status, stop_builder=stop_builder)

    async def _wrap_up(self, follower: _Follower, status: int, *, stop_builder: bool) -> None:
        """After the outcome: stop the builder if asked, end the log, drop the build's events."""
        if stop_builder:
            self._told_to_stop.add(follower.build_id)
            await self._tell_builder_to_stop(follower.node_id, follower.build_id)
        try:
            await close_log(self.conn, follower.build_id, status)
            await self.conn.js.purge_stream(BUILD_EVENTS_STREAM, subject=build_events_subject(follower.build_id))
        except (NatsError, TimeoutError) as exc:
            log.warning("build %s: log end or events purge failed: %s", follower.build_id, exc)

    async def _record(self, follower: _Follower, change: Callable[[pb.Build], pb.Build]) -> bool:
        """Write a change of a build this leader runs; False once it is no longer RUNNING on that node."""
        assert self._writer is not None, "start() sets the term's writer"
        writer = self._writer

        def attempt() -> Attempt[bool]:
            build = self.view.build(follower.build_id)
            if build is None or build.status != RUNNING or build.node_id != follower.node_id:
                return Attempt(None, False)
            return Attempt(writer.txn("build").put(change(build)), True)

        try:
            return await commit_with_retry(
                writer, attempt, clock=self.clock, contended=f"build {follower.build_id}", landed=decide_again
            )
        except RetriesExhausted:
            log.warning("build %s: gave up writing after repeated conflicts", follower.build_id)
            return False
