"""HistoryRecorder (``lease.metrics-history``): every 10 s, the heartbeats' figures as one point per env,
node and proxy in ``ZATTERA_METRICS`` (an env's with each replica's CPU and memory); every 5 min, those points
downsampled into ``ZATTERA_METRICS_5M``; and the env's deploy and scale events as marks (docs/observability.md,
"History").

The loop writes no state (no fenced write): it publishes points without headers (a ``Nats-Msg-Id`` would
double a point's stored size); a point published twice across a failover (two leaders in one slot) is
harmless, readers keep the last point of a slot (``shared.history.dense``). Its passes are due at
each 10-s boundary of the injected clock (``seconds_until_due``). A new term's first pass only reads the
counters (it writes nothing: the slot that just ended was the previous leader's to write, and rewriting it
from a partial view replaced a good point); its 5-min bucket starts empty (the bucket a failover cuts is
downsampled from the points the new leader saw: ``samples`` says how many).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import history as H
from shared import keys as K
from shared.deployments import desired_replicas
from shared.live import LiveView
from shared.loop import LeaderLoop, LoopDeps, Scope
from shared.provisioning import recorded_config
from shared.state.changes import Change
from shared.subjects import EVENTS_SUBJECT_PREFIX

log = logging.getLogger(__name__)

UP_STATES = frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY})
PUBLISH_CONCURRENCY = 256


class HistoryRecorder(LeaderLoop):
    name = "metrics-history"
    kinds = frozenset({K.ENV})
    """A kind must be named (none = every kind); changes never trigger a pass (:meth:`scope_of`)."""

    def __init__(self, deps: LoopDeps, *, live: LiveView, span: int = H.RAW_SPAN) -> None:
        super().__init__(deps, tick=float(span))
        self.live = live
        self.span = span
        self.recorder = H.Recorder()
        self.downsampler = H.Downsampler()
        self.replicas = H.ReplicaRecorder()
        self.last_slot: int | None = None
        self.published = 0
        self.pass_seconds = 0.0
        """CPU seconds (process time) spent in passes: the benchmark's figure."""
        self._events_sub: object | None = None
        self._streams_ready = False
        self.primed = False

    def on_term_start(self) -> None:
        self.recorder = H.Recorder()
        self.downsampler = H.Downsampler()
        self.replicas = H.ReplicaRecorder()
        self.last_slot = None
        self.primed = False

    async def begin_term(self) -> None:
        await self.ensure_streams()

        async def on_event(msg: Msg) -> None:
            with contextlib.suppress(Exception):
                await self.record_mark(pb.Event.FromString(msg.data))

        self._events_sub = await self.conn.nc.subscribe(EVENTS_SUBJECT_PREFIX + ">", cb=on_event)

    async def end_term(self) -> None:
        sub, self._events_sub = self._events_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]

    async def ensure_streams(self) -> None:
        if self._streams_ready:
            return
        recorded = await recorded_config(self.conn.js)
        await H.ensure_streams(self.conn.js, recorded.replicas if recorded is not None else 1)
        self._streams_ready = True

    def scope_of(self, changes: set[Change]) -> Scope:
        return frozenset()  # passes keep the clock's 10-s slots, whatever changes

    def seconds_until_due(self) -> float | None:
        now = self.clock.now()
        return (H.bucket_of(now, self.span) + self.span) - now

    async def record_mark(self, event: pb.Event) -> None:
        if event.kind not in H.MARK_KINDS or not event.environment_id:
            return
        at = event.meta.created_at.seconds + event.meta.created_at.nanos / 1e9
        await self.conn.js.publish(
            H.mark_subject(event.environment_id),
            H.mark_of(at, event.kind, event.message),
            headers={"Nats-Msg-Id": f"mark:{event.meta.id}"},
        )

    def collect(self, now: float) -> dict[str, cpb.MetricPoint]:
        """The points of this pass (pure over the view and the live samples)."""
        envs: dict[str, H.EnvFacts] = {}
        env_of_instance: dict[str, str] = {}
        versions: dict[str, int] = {}
        for env in self.view.envs():
            env_id = env.meta.id
            running = 0
            for a in self.view.assignments(env_id):
                env_of_instance[a.meta.id] = env_id
                versions[a.meta.id] = self._version(a.release_id)
                if (
                    a.desired == pb.ASSIGNMENT_DESIRED_RUN
                    and not a.job_id
                    and a.release_id == env.active_release_id
                    and a.observed.state in UP_STATES
                ):
                    running += 1
            envs[env_id] = H.EnvFacts(desired=desired_replicas(env), running=running)
        node_heartbeats = self.live.fresh_node_heartbeats()
        points = self.recorder.points(
            now,
            node_heartbeats,
            self.live.fresh_proxy_heartbeats(),
            envs,
            env_of_instance,
        )
        self.replicas.add(points, node_heartbeats, env_of_instance, versions)
        return points

    def _version(self, release_id: str) -> int:
        release = self.view.release(release_id) if release_id else None
        return release.version if release is not None else 0

    async def run_pass(self) -> None:
        now = self.clock.now()
        slot = H.bucket_of(now, self.span)
        if slot == self.last_slot:
            return  # woken twice in one slot (a change, the tick): one point per slot
        started = time.process_time()
        points = self.collect(now)
        self.last_slot = slot
        if not self.primed:
            # A term's first pass only reads the counters: the slot that just ended is the previous leader's
            # (it wrote it at the boundary), and this term has no counters of its own to measure it by.
            self.primed = True
            self.replicas.labelled = set()  # nothing of this pass is written: label the next one
            self.pass_seconds += time.process_time() - started
            return
        done = self.downsampler.add(points, slot - self.span)  # the points are of the slot that just ended
        self.pass_seconds += time.process_time() - started
        await self.ensure_streams()
        await self.publish({**points, **done})

    async def publish(self, points: Mapping[str, cpb.MetricPoint]) -> None:
        started = time.process_time()
        items = list(points.items())
        for first in range(0, len(items), PUBLISH_CONCURRENCY):
            chunk = items[first : first + PUBLISH_CONCURRENCY]
            results = await asyncio.gather(
                *(self.conn.js.publish(name, point.SerializeToString()) for name, point in chunk),
                return_exceptions=True,
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                log.warning("metrics history: %d of %d points not stored: %s", len(failed), len(chunk), failed[0])
            self.published += len(chunk) - len(failed)
        self.pass_seconds += time.process_time() - started
