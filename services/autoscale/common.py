"""What the three scaling loops share: how an env's current replica
count is read, the fenced ``effective_replicas`` write, and :class:`ScalingLoop`, the event-driven loop
shape that reacts to live samples as they arrive.

Every write of ``effective_replicas`` expects the env's revision as the decision read it. An operator
edit (or another loop's or the activator's write) in between makes the server refuse the write; the
loop then waits until its view has caught up, re-reads the env and decides again. Nothing is
clobbered and no bookkeeping (cooldown, events) happens for a write that did not land.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.clock import stamp
from shared.decision import Decision
from shared.deployments import owns_scaling
from shared.events import scale_event as shared_scale_event
from shared.live import ENV_TRAFFIC, INSTANCE, LiveView
from shared.loop import FULL, LeaderLoop, LoopDeps, Scope
from shared.settings import DEFAULTS
from shared.state.changes import Change, ChangeFeed
from shared.state.reader import StateReader
from shared.txn import Txn, Writer

log = logging.getLogger(__name__)

V = TypeVar("V")

CATCH_UP_TIMEOUT = 2.0
"""How long a scaling write that conflicted waits for the view to see the write that won."""


@dataclass(frozen=True, slots=True)
class Pause:
    """Why the scaling loops leave an env alone this pass, whatever its load says."""

    reason: str
    restarts_spell: bool
    """True: the loop's timing state for the env (low spell, last activity) starts afresh after the pause,
    so the next look grants a full window; False: it is kept (missing data must not read as idle)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """What one scaling decision reads: the state, the live samples, the env at the revision its write will
    expect, and ``now``."""

    view: StateReader
    live: LiveView
    env: pb.Environment
    revision: int
    now: float

    def write(self, current: int, target: int) -> ReplicaWrite:
        return ReplicaWrite(self.env, self.revision, current, target)


DEPLOYMENT_UNDER_WAY = Pause("deployment under way (not promoted yet)", restarts_spell=True)
NO_FRESH_PROXY_DATA = Pause("no fresh proxy data (frozen)", restarts_spell=False)


def scaling_paused(view: StateReader, live: LiveView, env_id: str, *, from_proxy_data: bool) -> Pause | None:
    """The guards every scaling loop applies (None: it may decide): a deployment owns the env's replicas
    until it promotes (a draining one holds only its blue), and a loop driven by proxy traffic waits
    while no proxy reports (no data is not zero traffic)."""
    if owns_scaling(view, env_id):
        return DEPLOYMENT_UNDER_WAY
    if from_proxy_data and not live.has_fresh_traffic_data():
        return NO_FRESH_PROXY_DATA
    return None


def wake_target(env: pb.Environment) -> int:
    """A woken (or minimum) env runs max(min, 1) replicas, never 0."""
    return max(env.service.replicas.min, 1)


@dataclass(frozen=True, slots=True)
class ReplicaWrite:
    """Set ``effective_replicas`` of ``env`` (as read at ``revision``) from ``current`` to ``target``."""

    env: pb.Environment
    revision: int
    current: int
    target: int

    @property
    def env_id(self) -> str:
        return self.env.meta.id


def scale_event(
    write: ReplicaWrite, kind: str, actor: str, message: str, now: float, *, logger: logging.Logger | None = None
) -> pb.Event:
    """The event of a landed ``effective_replicas`` write (see :func:`shared.events.scale_event`); with
    ``logger``, the message is also logged there, naming the env and the actor."""
    if logger is not None:
        logger.info("%s (env %s, %s)", message, write.env_id, actor)
    return shared_scale_event(
        write.env, write.revision, write.current, write.target, kind=kind, actor=actor, message=message, now=now
    )


def remember(memory: dict[str, V], env_id: str, value: V | None) -> None:
    """Keep ``value`` as the env's entry of a scaling loop's per-env memory (its timer, its low spell);
    None forgets the env."""
    if value is None:
        memory.pop(env_id, None)
    else:
        memory[env_id] = value


def effective_env(write: ReplicaWrite, now: float) -> pb.Environment:
    """A copy of the env as decided on, with the decided ``effective_replicas``."""
    env = pb.Environment()
    env.CopyFrom(write.env)
    env.effective_replicas = write.target
    stamp(env.meta.updated_at, now)
    return env


def effective_txn(writer: Writer, write: ReplicaWrite, now: float) -> Txn:
    """The fenced write: the env as decided on, expecting the revision the decision read."""
    return writer.txn(label="effective_replicas").put(effective_env(write, now), expect=write.revision)


class ScalingLoop(LeaderLoop, Generic[V]):
    """A scaling loop: full passes at term start and on every tick; in between, re-evaluates only the
    envs that a state change or a fresh live sample touched, as soon as it arrives.

    Subclasses implement :meth:`decide` (the pure ``evaluate`` of the module plus the timer updates of
    outcomes that write nothing) and :meth:`committed` (bookkeeping after a write landed). ``memory`` is
    the loop's per-env timing (an idle timer, a low spell: :func:`remember`), forgotten at each new term and
    for an env whose write landed.
    """

    kinds = frozenset({K.ENV, K.DEPLOYMENT})
    live_kinds: frozenset[str] = frozenset({ENV_TRAFFIC})

    def __init__(self, deps: LoopDeps, *, live: LiveView, tick: float = DEFAULTS.loop_tick) -> None:
        super().__init__(deps, tick=tick)
        self.live = live
        self.writes = 0
        self.conflicts = 0
        self.memory: dict[str, V] = {}

    def on_term_start(self) -> None:
        self.memory = {}

    @abstractmethod
    def decide(self, at: Reading) -> ReplicaWrite | None:
        """Evaluate one env; return the write to make, if any."""

    @abstractmethod
    def committed(self, write: ReplicaWrite, now: float) -> pb.Event | None:
        """Record a landed write (timers) and return the event to publish, if any."""

    # ------------------------------------------------------------------ passes

    async def run_pass(self) -> None:
        await self.reconcile(None)

    async def reconcile(self, env_ids: Iterable[str] | None) -> None:
        """Decide and commit for ``env_ids`` (None = every env); re-decide once after a conflict."""
        now = self.clock.now()
        envs = self.view.envs() if env_ids is None else [e for i in sorted(env_ids) if (e := self.view.env(i))]
        retry = await self._commit(self._decide_all(envs, now), now)
        if retry:
            await self.view.catch_up(CATCH_UP_TIMEOUT)
            again = [e for i in sorted(retry) if (e := self.view.env(i))]
            # A second conflict is left to the change feed: the conflicting write wakes this loop again.
            await self._commit(self._decide_all(again, now), now)

    def _decide_all(self, envs: list[pb.Environment], now: float) -> list[ReplicaWrite]:
        writes = []
        for env in envs:
            write = self.decide(Reading(self.view, self.live, env, self.view.rev(K.env(env.meta.id)), now))
            if write is not None:
                writes.append(write)
        return writes

    async def _commit(self, writes: list[ReplicaWrite], now: float) -> set[str]:
        """Commit the writes in few batches; returns the env ids whose write did not land (the env changed
        under the decision). Each write expects the revision its decision read: the view's, as nothing
        awaits between deciding and this commit."""
        if not writes:
            return set()
        landed = await self.commit_decisions(
            [Decision(f"effective_replicas of env {w.env_id}", puts=[effective_env(w, now)]) for w in writes]
        )
        retry: set[str] = set()
        events: list[pb.Event] = []
        for write, ok in zip(writes, landed, strict=True):
            if not ok:
                self.conflicts += 1
                retry.add(write.env_id)
                continue
            self.writes += 1
            self.memory.pop(write.env_id, None)  # the env changed: its timing starts afresh
            event = self.committed(write, now)
            if event is not None:
                events.append(event)
        if events:
            await self.events.publish(*events)
        return retry

    # ------------------------------------------------------------------ the term

    def extra_feeds(self) -> Sequence[ChangeFeed]:
        return [self.live.subscribe(self.live_kinds)]

    def scope_of(self, changes: set[Change]) -> Scope:
        """Only the envs the changes touched (a full pass when one cannot be told)."""
        touched = self.affected_envs(changes)
        return FULL if touched is None else frozenset(touched)

    async def run_partial_pass(self, scope: frozenset[str]) -> None:
        await self.reconcile(scope)

    def affected_envs(self, changes: set[Change]) -> set[str] | None:
        """Env ids touched by state or live changes; None when one cannot be mapped (a full pass)."""
        envs: set[str] = set()
        for kind, ident in changes:
            if kind in (K.ENV, ENV_TRAFFIC):
                envs.add(ident)
                continue
            if kind == INSTANCE:
                sampled = self.view.assignment(ident)
                if sampled is not None:  # a sample of an unknown assignment counts for nothing
                    envs.add(sampled.environment_id)
                continue
            obj = self.view.get(kind, ident)
            if obj is not None:
                envs.add(getattr(obj, "environment_id", ""))
            elif kind in self.kinds:
                return None  # a deleted assignment/deployment: its env is unknown here
        return envs
