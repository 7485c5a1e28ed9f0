"""BuildDispatcher (lease ``builds``): QUEUED builds → builder nodes → durable outcome.

Reference rules kept (spec builds-retention §3): builder = ALIVE, schedulable, label ``builder=true``;
fewest RUNNING builds first, tie by node id (sticky when idle); RUNNING is recorded before the builder
is contacted; outcome texts ``dispatch: …``, ``build stream: …``, ``build failed``,
``build ended without producing an image``, ``builder lost``; refs ``<repo>:<lower build id>`` and
``<repo>@<digest>``; one ``build.waiting_for_builder`` warning per wait.

Fixed here:

* The claim is a compare-and-set of the build's revision inside a batch fenced by the lease, so a
  build is never dispatched twice, even across a failover (§3.13).
* A per-builder concurrency cap (default 2) and platform matching: a builder builds its native
  ``os_arch`` plus whatever its ``zattera.dev/build-platforms`` label lists (comma separated, emulation).
* Builder events are durable (stream ``ZATTERA_BUILD_EVENTS``). A new leader replays them for every
  RUNNING build, so an outcome reported during the failover is not lost, and applies the builder-lost
  timeout from the last event: a live event counts when it arrives; a replayed one counts at its own
  stream timestamp (when JetStream stored it, from the message metadata; never later than now), so the
  timeout runs from the builder's real last event and not from ``Build.last_event_at``, which is only
  checkpointed every ``checkpoint_interval`` (a floor when the replay holds no event). No build stays
  RUNNING forever (§3.12).
* Log lines go to the durable build-log stream (shared/buildlogs.py), readable after a failover.
* Cancel: an operator writes CANCELED (shared/buildcancel.py); the dispatcher tells the builder to
  stop on ``zattera.agent.<node>.build.cancel`` — also when a builder keeps streaming for a build that
  already ended (canceled, or failed as lost).

The decisions are pure (:func:`evaluate`, :func:`pick_builder`, :func:`apply_event`,
:func:`finished_build`); :class:`BuildDispatcher` feeds them from the view and the event stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.buildlogs import (
    ERROR_HEADER,
    TERMINAL_STATUSES,
    append_log_lines,
    build_id_of_events_subject,
    cancel_build_subject,
    close_log,
    last_copied_event_seq,
    read_build_log,
    run_build_subject,
    sender_of_events_subject,
)
from shared.events import WARNING, make_event
from shared.lease import Leadership
from shared.loop import LeaderLoop
from shared.natsio import BUILD_EVENTS_STREAM, build_events_subject, build_log_subject
from shared.registry import repository
from shared.tasks import cancel_and_wait
from shared.telemetry import inject, span
from shared.txn import CommitUnknown, Conflict, Deposed
from shared.view import CONSUMER_HEARTBEAT, guard_ordered_consumer

log = logging.getLogger(__name__)

NO_RESPONDERS_GRACE = 3.0
"""How long a RunBuild request nobody received is sent again (a builder reconnecting to another server)."""
NO_RESPONDERS_PAUSE = 0.25
CLAIM_IN_FLIGHT = 12.0
"""A RUNNING build resumed by a new term (or a new leader) within this many seconds of its claim is sent its
RunBuild again: its claimer may have been deposed between the claim landing (its reply lost with a NATS
server) and sending the request. Longer than a claim's commit timeout (10 s); the builder accepts a build id
it already has without running it twice. Older resumed builds are only followed (a silent one is lost)."""
REQUEST_ATTEMPT = 1.0
"""A builder accepts a RunBuild at once; an attempt unanswered this long is sent again (its NATS server lost
with the request or the reply in flight). Builders accept a build id they run or ran again without starting
it twice, so a resent request is safe."""

WAITING_KIND = "build.waiting_for_builder"
WAITING_MESSAGE = "no schedulable builder node (cordoned, down, or builder=false); the build stays queued"
BUILDER_LABEL = "builder"
OS_ARCH_LABEL = "zattera.dev/os-arch"
BUILD_PLATFORMS_LABEL = "zattera.dev/build-platforms"

BUILDER_LOST = "builder lost"
BUILD_FAILED = "build failed"
NO_IMAGE = "build ended without producing an image"

RUNNING = pb.BUILD_STATUS_RUNNING
QUEUED = pb.BUILD_STATUS_QUEUED


@dataclass(frozen=True, slots=True)
class BuildDispatcherConfig:
    """What the dispatcher stamps into requests, and its timers (seconds)."""

    source_url_base: str = ""
    """Prefix of the tarball digest in ``source_url``; "" = the object name in ``zattera-sources``."""
    registry_addr: str = ""
    """Registry host prefixed to image refs; "" = the object-store registry (refs ``<project>/<app>``)."""
    local_load: bool = False
    """Dev mode: builders load the image locally; the build's ref is then the push (tag) ref."""
    builder_lost_timeout: float = 240.0
    builder_concurrency: int = 2
    checkpoint_interval: float = 15.0
    request_timeout: float = 5.0


# ---------------------------------------------------------------------------------------- pure decisions


def seconds(ts: Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def timestamp(at: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(at * 1e9))
    return ts


def is_builder(node: pb.Node) -> bool:
    return node.status == pb.NODE_STATUS_ALIVE and node.schedulable and node.labels.get(BUILDER_LABEL) == "true"


def builder_platforms(node: pb.Node) -> frozenset[str]:
    """The platforms a builder can produce: its own, plus the emulated ones its label declares."""
    native = {p for p in (node.os_arch, node.labels.get(OS_ARCH_LABEL, "")) if p}
    extra = {p.strip() for p in node.labels.get(BUILD_PLATFORMS_LABEL, "").split(",") if p.strip()}
    return frozenset(native | extra)


def can_build(node: pb.Node, platforms: Sequence[str]) -> bool:
    """Empty platforms = the builder's native one (any builder can)."""
    return not platforms or set(platforms) <= builder_platforms(node)


def pick_builder(candidates: Iterable[pb.Node], load: Mapping[str, int], cap: int) -> str | None:
    """Fewest running builds, tie by node id, among candidates below the cap."""
    free = [(load.get(n.meta.id, 0), n.meta.id) for n in candidates if load.get(n.meta.id, 0) < cap]
    return min(free)[1] if free else None


@dataclass(frozen=True, slots=True)
class Dispatch:
    build_id: str
    node_id: str


@dataclass(frozen=True, slots=True)
class Waiting:
    build_id: str
    message: str


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    dispatch: tuple[Dispatch, ...] = ()
    waiting: tuple[Waiting, ...] = ()
    """QUEUED builds no builder node can take at all (not merely busy ones)."""
    lost: tuple[str, ...] = ()
    next_deadline: float | None = None


def stored_at(msg: Msg) -> float:
    """When JetStream stored the message (its stream timestamp, from the delivery metadata), in epoch seconds."""
    return msg.metadata.timestamp.timestamp()


def last_event_time(build: pb.Build, seen: Mapping[str, float]) -> float:
    return max(seconds(build.last_event_at), seconds(build.started_at), seen.get(build.meta.id, 0.0))


def evaluate(
    builds: Sequence[pb.Build],
    nodes: Sequence[pb.Node],
    *,
    now: float,
    last_event_seen: Mapping[str, float],
    cap: int,
    lost_timeout: float,
) -> DispatchPlan:
    """One pass: which RUNNING builds are lost, which QUEUED builds go where (in id order), which wait."""
    load: dict[str, int] = {}
    lost: list[str] = []
    next_deadline: float | None = None
    queued: list[pb.Build] = []
    for build in builds:
        if build.status == RUNNING:
            load[build.node_id] = load.get(build.node_id, 0) + 1
            deadline = last_event_time(build, last_event_seen) + lost_timeout
            if now >= deadline:
                lost.append(build.meta.id)
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
        elif build.status == QUEUED:
            queued.append(build)
    builders = [n for n in nodes if is_builder(n)]
    candidates_by_platforms: dict[tuple[str, ...], list[pb.Node]] = {}
    dispatch: list[Dispatch] = []
    waiting: list[Waiting] = []
    for build in queued:
        platforms = tuple(sorted(build.platforms))
        candidates = candidates_by_platforms.get(platforms)
        if candidates is None:
            candidates = [n for n in builders if can_build(n, platforms)]
            candidates_by_platforms[platforms] = candidates
        if not candidates:
            message = (
                WAITING_MESSAGE
                if not builders
                else f"no builder node can build {', '.join(platforms)}; the build stays queued"
            )
            waiting.append(Waiting(build.meta.id, message))
            continue
        node_id = pick_builder(candidates, load, cap)
        if node_id is None:
            continue
        load[node_id] = load.get(node_id, 0) + 1
        dispatch.append(Dispatch(build.meta.id, node_id))
    return DispatchPlan(tuple(dispatch), tuple(waiting), tuple(lost), next_deadline)


@dataclass(frozen=True, slots=True)
class Verdict:
    status: int
    error: str = ""
    digest: str = ""
    platforms: tuple[str, ...] = ()


@dataclass(slots=True)
class StreamProgress:
    """What a build's events told so far (the last non-empty digest and platforms win)."""

    digest: str = ""
    platforms: tuple[str, ...] = ()


def apply_event(progress: StreamProgress, event: cpb.BuildEvent) -> Verdict | None:
    """The reference's per-event order: digest, platforms, error, FAILED status; success only at the end."""
    if event.image_digest:
        progress.digest = event.image_digest
    if event.platforms:
        progress.platforms = tuple(event.platforms)
    if event.error:
        return Verdict(pb.BUILD_STATUS_FAILED, event.error)
    if event.status == pb.BUILD_STATUS_FAILED:
        return Verdict(pb.BUILD_STATUS_FAILED, BUILD_FAILED)
    if event.done:
        if not progress.digest:
            return Verdict(pb.BUILD_STATUS_FAILED, NO_IMAGE)
        return Verdict(pb.BUILD_STATUS_SUCCEEDED, digest=progress.digest, platforms=progress.platforms)
    return None


def push_ref(build: pb.Build, config: BuildDispatcherConfig) -> str:
    return f"{repository(build.project_id, build.app_id, config.registry_addr)}:{build.meta.id.lower()}"


def deploy_ref(build: pb.Build, digest: str, config: BuildDispatcherConfig) -> str:
    if config.local_load:
        return push_ref(build, config)
    return f"{repository(build.project_id, build.app_id, config.registry_addr)}@{digest}"


def copy_build(build: pb.Build) -> pb.Build:
    b = pb.Build()
    b.CopyFrom(build)
    return b


def claimed_build(build: pb.Build, node_id: str, now: float) -> pb.Build:
    b = copy_build(build)
    b.status = RUNNING
    b.node_id = node_id
    b.started_at.CopyFrom(timestamp(now))
    b.last_event_at.CopyFrom(timestamp(now))
    b.log_subject = build_log_subject(build.meta.id)
    b.error = ""
    return b


def finished_build(build: pb.Build, verdict: Verdict, config: BuildDispatcherConfig, now: float) -> pb.Build:
    b = copy_build(build)
    b.status = verdict.status  # type: ignore[assignment]
    b.finished_at.CopyFrom(timestamp(now))
    if verdict.status == pb.BUILD_STATUS_SUCCEEDED:
        b.image_ref = deploy_ref(build, verdict.digest, config)
        b.image_digest = verdict.digest
        b.error = ""
        if verdict.platforms:
            del b.platforms[:]
            b.platforms.extend(verdict.platforms)
    else:
        b.error = verdict.error
    return b


def run_request(build: pb.Build, config: BuildDispatcherConfig, app: pb.App | None = None) -> cpb.RunBuildRequest:
    request = cpb.RunBuildRequest(build=build, push_image_ref=push_ref(build, config))
    if app is not None:
        request.build_config.CopyFrom(app.build)
        request.build_args.update(app.build.build_args)
    if build.tarball_digest:
        request.source_url = config.source_url_base + build.tarball_digest
    if build.git_clone_url:
        request.git.clone_url = build.git_clone_url
        request.git.ref = build.git_sha or build.git_branch
    return request


# ---------------------------------------------------------------------------------------- the loop


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


class BuildDispatcher(LeaderLoop):
    name = "builds"
    kinds = frozenset({K.BUILD, K.NODE})

    def __init__(self, *, config: BuildDispatcherConfig | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config or BuildDispatcherConfig()
        self._followers: dict[str, _Follower] = {}
        self._warned: set[str] = set()
        self._told_to_stop: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._events_sub: Any = None
        self._replay_until = 0
        self._next_deadline: float | None = None

    # ------------------------------------------------------------------ term lifecycle

    def on_term_start(self) -> None:
        self._warned.clear()
        self._told_to_stop.clear()
        self._next_deadline = None

    async def build_log(self, build_id: str) -> list[str]:
        """The reference's ``BuildLog(id)``, read from the durable stream (any leader wrote it)."""
        return await read_build_log(self.conn, build_id)

    def seconds_until_due(self) -> float | None:
        return None if self._next_deadline is None else self._next_deadline - self.clock.now()

    async def run(self, leadership: Leadership) -> None:
        self.writer = self.fenced_writer(leadership)
        try:
            await self.view.wait_fresh()
            await self._start_following()
            await super().run(leadership)
        finally:
            await self._stop_following()

    async def _start_following(self) -> None:
        """Resume every RUNNING build, then replay the durable events (what a previous leader missed)."""
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

    async def _stop_following(self) -> None:
        if self._events_sub is not None:
            with contextlib.suppress(Exception):
                await self._events_sub.unsubscribe()
            self._events_sub = None
        tasks = [f.task for f in self._followers.values() if f.task] + list(self._tasks)
        self._followers.clear()
        await cancel_and_wait(*tasks)
        self._tasks.clear()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ one pass

    async def run_pass(self) -> None:
        self._reconcile_followers()
        seen = {f.build_id: f.last_event_at for f in self._followers.values()}
        plan = evaluate(
            self.view.builds(),
            self.view.nodes(),
            now=self.clock.now(),
            last_event_seen=seen,
            cap=self.config.builder_concurrency,
            lost_timeout=self.config.builder_lost_timeout,
        )
        self._next_deadline = plan.next_deadline
        for build_id in plan.lost:
            self._conclude(build_id, Verdict(pb.BUILD_STATUS_FAILED, BUILDER_LOST), stop_builder=True)
        await self._claim(plan.dispatch)
        await self._warn(plan.waiting)

    def _reconcile_followers(self) -> None:
        """Follow every RUNNING build; let go of builds that ended elsewhere (canceled by an operator)."""
        for build_id, follower in list(self._followers.items()):
            build = self.view.build(build_id)
            if follower.concluding or (build and build.status == RUNNING and build.node_id == follower.node_id):
                continue
            del self._followers[build_id]
            if follower.task:
                follower.task.cancel()
            if build is not None and build.status in TERMINAL_STATUSES:
                self._spawn(self._wrap_up(follower, build.status, stop_builder=True))
        for build in self.view.builds():
            if build.status == RUNNING and build.node_id and build.meta.id not in self._followers:
                self._follow(build, resumed=True)

    async def _claim(self, dispatches: Sequence[Dispatch]) -> None:
        if not dispatches or self.writer is None:
            return
        now = self.clock.now()
        claims: list[pb.Build] = []
        txns = []
        traces: dict[str, dict[str, str]] = {}
        for d in dispatches:
            build = self.view.build(d.build_id)
            if build is None:
                continue
            traces[d.build_id] = self.view.trace_headers(K.build(d.build_id))  # the creator's (e.g. the CLI's)
            claimed = claimed_build(build, d.node_id, now)
            claims.append(claimed)
            txns.append(self.writer.txn("claim build").put(claimed))
        results = await self.writer.commit_many(txns)
        for claimed, result in zip(claims, results, strict=True):
            if result is not None:
                log.info("build %s: claim refused (%s); re-deciding", claimed.meta.id, result)
                continue
            self._warned.discard(claimed.meta.id)
            follower = self._follow(claimed, resumed=False)
            follower.last_event_at = now
            follower.checkpointed_at = now
            self._spawn(self._send(claimed, follower, traces.get(claimed.meta.id) or None))

    async def _warn(self, waiting: Sequence[Waiting]) -> None:
        events = []
        for w in waiting:
            if w.build_id in self._warned:
                continue
            self._warned.add(w.build_id)
            build = self.view.build(w.build_id)
            log.warning("build %s: %s", w.build_id, w.message)
            events.append(
                make_event(
                    WAITING_KIND,
                    w.message,
                    clock=self.clock,
                    severity=WARNING,
                    project_id=build.project_id if build else "",
                    app_id=build.app_id if build else "",
                    environment_id=build.environment_id if build else "",
                    fields={"build_id": w.build_id},
                )
            )
        if events:
            await self.events.publish(*events)

    # ------------------------------------------------------------------ contacting builders

    async def _send(self, build: pb.Build, follower: _Follower, trace: dict[str, str] | None = None) -> None:
        request = run_request(build, self.config, self.view.app(build.app_id))
        try:
            with span("builds.dispatch", headers=trace, build_id=build.meta.id, node_id=build.node_id):
                reply = await self._request_build(build.node_id, request.SerializeToString(deterministic=True))
        except (NatsError, TimeoutError) as exc:
            self._conclude(build.meta.id, Verdict(pb.BUILD_STATUS_FAILED, f"dispatch: {exc}"))
            return
        refused = (reply.headers or {}).get(ERROR_HEADER)
        if refused:
            self._conclude(build.meta.id, Verdict(pb.BUILD_STATUS_FAILED, f"build stream: {refused}"))

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
        follower = _Follower(build.meta.id, build.node_id, resumed, checkpointed_at=seconds(build.last_event_at))
        self._followers[build.meta.id] = follower
        follower.task = asyncio.create_task(self._run_follower(follower), name=f"build:{build.meta.id}")
        if resumed and self.clock.now() - seconds(build.started_at) < CLAIM_IN_FLIGHT:
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
            self._conclude(build.meta.id, Verdict(pb.BUILD_STATUS_FAILED, f"build stream: {refused}"))

    def _conclude(self, build_id: str, verdict: Verdict, *, stop_builder: bool = False) -> None:
        follower = self._followers.get(build_id)
        if follower is None or follower.concluding:
            return
        follower.concluding = True
        follower.queue.put_nowait(_Conclude(verdict, stop_builder))

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
            if build is not None and build.status == RUNNING and build.node_id:
                follower = self._follow(build, resumed=True)
            else:
                if live and build is not None and build.status in TERMINAL_STATUSES and not event.done:
                    self._stop_stray_builder(build)
                return
        now = self.clock.now()
        # A replayed event (stored before this term began) counts when the stream stored it, not now.
        at = now if live else min(stored_at(msg), now)
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
                if follower.last_event_at - follower.checkpointed_at >= self.config.checkpoint_interval:
                    await self._checkpoint(follower)
        except Deposed:
            return

    async def _checkpoint(self, follower: _Follower) -> None:
        at = follower.last_event_at

        def change(build: pb.Build) -> pb.Build:
            b = copy_build(build)
            b.last_event_at.CopyFrom(timestamp(at))
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
        assert self.writer is not None
        key = K.build(follower.build_id)
        for _ in range(10):
            build = self.view.build(follower.build_id)
            if build is None or build.status != RUNNING or build.node_id != follower.node_id:
                return False
            rev = self.view.rev(key)
            try:
                await self.writer.commit(self.writer.txn("build").put(change(build)))
                return True
            except Deposed:
                raise
            except Conflict:
                await self._await_newer(key, rev)
            except CommitUnknown:
                continue
        log.warning("build %s: gave up writing after repeated conflicts", follower.build_id)
        return False

    async def _await_newer(self, key: str, rev: int, timeout: float = 2.0) -> None:
        """After a refused write, wait until the view shows the newer revision of ``key``."""
        feed = self.view.subscribe({K.BUILD})
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while self.view.rev(key) == rev and loop.time() < deadline:
                await feed.wait(timeout=deadline - loop.time())
        finally:
            feed.close()
