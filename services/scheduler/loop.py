"""The placement loop: leader-gated by ``lease.scheduler``.

It runs a full pass at the start of a term, on changes of envs, releases, deployments, nodes,
assignments (observed reports included) and volumes, coalesced, and every 15 s. A pass runs in this
order, each step deciding purely from the view and committing before the next step reads:

1. volumes: auto-create and NODE_LOST / recovered (so placement sees the pins);
2. envs, in id order: one atomic write per env, all packed into few batches (``commit_many``); the
   decisions go through one ``PlacementIndex`` so env B is placed seeing env A's picks;
3. volume fencing leases (a replica placed in step 2 is leased in the same pass);
4. orphans; 5. drains → DRAINED.

A refused write (a concurrent change) is logged and re-decided on the next pass, which that change
triggers; a lost lease stops the term. Lease renewals do not wake the loop again (no hot loop), and
recurring shortfall events are published when they start or change.
"""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from services.scheduler.convergence import FailureBackoff, evaluate_envs
from services.scheduler.decisions import Notices, event
from services.scheduler.drain import evaluate_drains
from services.scheduler.orphans import evaluate_orphans
from services.scheduler.volumes import evaluate_leases, evaluate_volumes
from shared import keys as K
from shared.events import WARNING
from shared.loop import LeaderLoop, LoopDeps
from shared.placement.explain import explain
from shared.placement.placement import PlacementError
from shared.settings import DEFAULTS
from shared.state.reader import StateReader


class Scheduler(LeaderLoop):
    name = "scheduler"
    kinds = frozenset({K.ENV, K.RELEASE, K.DEPLOYMENT, K.NODE, K.ASSIGNMENT, K.VOLUME})

    def __init__(self, deps: LoopDeps, *, tick: float = DEFAULTS.loop_tick) -> None:
        super().__init__(deps, tick=tick)
        self.backoff = FailureBackoff()
        self.notices = Notices()

    def on_term_start(self) -> None:
        self.backoff = FailureBackoff()
        self.notices = Notices()

    def seconds_until_due(self) -> float | None:
        return self.backoff.seconds_until_next(self.clock.now())

    async def run_pass(self) -> None:
        now = self.clock.now()
        view = self.view

        volumes = evaluate_volumes(view, now)
        await self.commit_decisions(volumes.writes)
        for (env_id, name), homeless in volumes.homeless.items():
            env = view.env(env_id)
            if self.notices.due(env_id, f"volume:{name}", homeless) and env is not None and homeless:
                await self.events.publish(event("volume.no_capacity", homeless, now, severity=WARNING, env=env))

        decisions = evaluate_envs(view, now, backoff=self.backoff)
        landed = await self.commit_decisions([d.writes for d in decisions])
        for decision, ok in zip(decisions, landed, strict=True):
            env_id = decision.env.meta.id
            if ok and decision.replaced_failed:
                self.backoff.record(env_id, now)
            shortfall = decision.shortfall
            condition = f"{shortfall.unplaced} unplaced: {shortfall.reason}" if shortfall is not None else None
            if self.notices.due(env_id, "schedule", condition) and shortfall is not None:
                await self.events.publish(no_capacity_event(view, decision.env, shortfall, now))
        self.notices.retain(env.meta.id for env in view.envs())

        leases = evaluate_leases(view, now)
        renewed = await self.commit_decisions(list(leases.values()))
        self.ignore_own_changes((K.VOLUME, vid) for vid, ok in zip(leases, renewed, strict=True) if ok)

        await self.commit_decisions(evaluate_orphans(view, now))
        await self.commit_decisions(evaluate_drains(view, now))


def no_capacity_event(view: StateReader, env: pb.Environment, shortfall: PlacementError, now: float) -> pb.Event:
    """The shortfall with why, per named filter, the other nodes take no more replicas (after this pass's
    picks): "placement: only 2 of 3 …; 5 nodes: 3 filtered by arch, 2 by memory"."""
    message = str(shortfall)
    release = view.release(env.active_release_id)
    why = explain(view, release, env.meta.id) if release is not None else None
    if why is not None:
        message += f"; {why.summary()}"
    ev = event("schedule.no_capacity", message, now, severity=WARNING, env=env)
    for name, count in why.filtered.items() if why is not None else ():
        ev.fields[f"filtered_by_{name.replace(' ', '_')}"] = str(count)
    return ev
