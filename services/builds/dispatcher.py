"""BuildDispatcher (lease ``builds``): QUEUED builds → builder nodes → durable outcome.

RUNNING is recorded before the builder is contacted; outcome texts ``dispatch: …``, ``build stream: …``;
one ``build.waiting_for_builder`` warning per wait. The decisions (builder choice, lost builds,
outcomes, refs) are pure, in planning.py; following each RUNNING build's events and contacting builders
is followers.py.

* The claim is a compare-and-set of the build's revision inside a batch fenced by the lease, so a
  build is never dispatched twice, even across a failover.
* A per-builder concurrency cap (default 2) and platform matching: a builder builds its native
  ``os_arch`` plus whatever its ``zattera.dev/build-platforms`` label lists (comma separated, emulation).
* Builder events are durable (stream ``ZATTERA_BUILD_EVENTS``). A new leader replays them for every
  RUNNING build, so an outcome reported during the failover is not lost, and applies the builder-lost
  timeout from the last event: a live event counts when it arrives; a replayed one counts at its own
  stream timestamp (when JetStream stored it, from the message metadata; never later than now), so the
  timeout runs from the builder's real last event and not from ``Build.last_event_at``, which is only
  checkpointed every ``checkpoint_interval`` (a floor when the replay holds no event). No build stays
  RUNNING forever.
* Log lines go to the durable build-log stream (shared/buildlogs.py), readable after a failover.
* Cancel: an operator writes CANCELED (shared/actions/builds.py); the dispatcher tells the builder to
  stop on ``zattera.agent.<node>.build.cancel`` — also when a builder keeps streaming for a build that
  already ended (canceled, or failed as lost).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from zattera.v1 import types_pb2 as pb

from services.builds.followers import BuildFollowers
from services.builds.planning import (
    BUILDER_LOST,
    WAITING_KIND,
    BuildDispatcherConfig,
    Dispatch,
    Verdict,
    Waiting,
    claimed_build,
    evaluate,
)
from shared import keys as K
from shared.buildlogs import read_build_log
from shared.decision import Decision
from shared.events import WARNING, make_event
from shared.loop import LeaderLoop, LoopDeps
from shared.settings import DEFAULTS

log = logging.getLogger(__name__)


class BuildDispatcher(LeaderLoop):
    name = "builds"
    kinds = frozenset({K.BUILD, K.NODE})

    def __init__(
        self, deps: LoopDeps, *, config: BuildDispatcherConfig | None = None, tick: float = DEFAULTS.loop_tick
    ) -> None:
        super().__init__(deps, tick=tick)
        self.config = config or BuildDispatcherConfig()
        self.followers = BuildFollowers(self.conn, self.view, self.clock, self.config)
        self._warned: set[str] = set()
        self._next_deadline: float | None = None

    # ------------------------------------------------------------------ term lifecycle

    def on_term_start(self) -> None:
        self._warned.clear()
        self._next_deadline = None

    async def begin_term(self) -> None:
        assert self.writer is not None
        await self.followers.start(self.writer)

    async def end_term(self) -> None:
        await self.followers.stop()

    def seconds_until_due(self) -> float | None:
        return None if self._next_deadline is None else self._next_deadline - self.clock.now()

    async def build_log(self, build_id: str) -> list[str]:
        """The build's log, read from the durable stream (any leader wrote it)."""
        return await read_build_log(self.conn, build_id)

    # ------------------------------------------------------------------ one pass

    async def run_pass(self) -> None:
        self.followers.reconcile()
        plan = evaluate(
            self.view.builds(),
            self.view.nodes(),
            now=self.clock.now(),
            last_event_seen=self.followers.last_event_seen(),
            cap=self.config.builder_concurrency,
            lost_timeout=self.config.builder_lost_timeout,
        )
        self._next_deadline = plan.next_deadline
        for build_id in plan.lost:
            self.followers.conclude(build_id, Verdict(pb.BUILD_STATUS_FAILED, BUILDER_LOST), stop_builder=True)
        await self._claim(plan.dispatch)
        await self._warn(plan.waiting)

    async def _claim(self, dispatches: Sequence[Dispatch]) -> None:
        if not dispatches or self.writer is None:
            return
        now = self.clock.now()
        claims: list[pb.Build] = []
        traces: dict[str, dict[str, str]] = {}
        for d in dispatches:
            build = self.view.build(d.build_id)
            if build is None:
                continue
            traces[d.build_id] = self.view.trace_headers(K.build(d.build_id))  # the creator's (e.g. the CLI's)
            claims.append(claimed_build(build, d.node_id, now))
        landed = await self.commit_decisions([Decision(f"claim build {c.meta.id}", puts=[c]) for c in claims])
        for claimed, ok in zip(claims, landed, strict=True):
            if not ok:
                continue
            self._warned.discard(claimed.meta.id)
            self.followers.dispatched(claimed, now, traces.get(claimed.meta.id) or None)

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
