"""The orchestrator leader loop (``lease.orchestrator``): drives every non-terminal deployment.

A pass reconciles the non-terminal deployments oldest id first (so a supersession resolves in the same
pass); each reconcile commits at most one :class:`~shared.decision.Decision` as one
fenced atomic batch. The loop wakes on deployment, assignment (and observed state), build, env, node
and release changes — a finished build or a node loss is acted on at once, not on the next tick — and
at the next deadline of any deployment (phase timeouts, health deadline, drain deadline), so timers
fire on time instead of up to a tick late. Everything is derived from durable state: a new leader
resumes from the recorded phase, and deadlines are absolute, so failover neither resets nor extends
them. Given the live view (``zattera-live``), it also wakes on every proxy heartbeat: a drain ends as soon
as every live proxy reports nothing in flight to the old release (:func:`~services.orchestrator.phases.drained`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, deployment_of, phase_label
from services.orchestrator.phases import decide, wake_at
from shared import keys as K
from shared.decision import Decision
from shared.deployments import is_terminal
from shared.live import NODE, PROXY, LiveView
from shared.loop import LeaderLoop, LoopDeps
from shared.settings import DEFAULTS
from shared.state.changes import ChangeFeed
from shared.telemetry import counter, span

log = logging.getLogger(__name__)

_transitions = counter("zattera.orchestrator.transitions", "deployment transitions committed")
_refused = counter("zattera.orchestrator.refused", "transitions refused because state changed meanwhile")


class Orchestrator(LeaderLoop):
    name = "orchestrator"
    kinds = frozenset({K.DEPLOYMENT, K.ASSIGNMENT, K.BUILD, K.ENV, K.NODE, K.RELEASE, K.JOB})

    def __init__(
        self,
        deps: LoopDeps,
        *,
        timers: Timers | None = None,
        tick: float = DEFAULTS.loop_tick,
        live: LiveView | None = None,
    ) -> None:
        super().__init__(deps, tick=tick)
        self.timers = timers or Timers()
        self.live = live
        """The proxies' heartbeats (None: every drain lasts its whole window)."""
        self._pass_started_at = float("-inf")

    def extra_feeds(self) -> Sequence[ChangeFeed]:
        return [self.live.subscribe([PROXY, NODE])] if self.live is not None else []

    def live_deployments(self) -> list[pb.Deployment]:
        return [d for d in self.view.deployments() if not is_terminal(d.phase)]

    async def run_pass(self) -> None:
        self._pass_started_at = self.clock.now()
        for d in self.live_deployments():
            await self.reconcile(d.meta.id)

    async def reconcile(self, deployment_id: str) -> Decision | None:
        """Decide one step for a deployment and commit it; None when nothing was written."""
        assert self.writer is not None, "reconcile needs the term's fenced writer"
        d = self.view.deployment(deployment_id)
        if d is None or is_terminal(d.phase):
            return None
        # Continue the trace of the deployment's last write (the CLI's create, then this loop's own steps).
        parent = self.view.trace_headers(K.deployment(deployment_id)) or None
        with span(
            "orchestrator.reconcile", headers=parent, deployment=deployment_id, phase=phase_label(d.phase)
        ) as current:
            # only a drain and a canary read it
            reads_live = d.phase in (pb.DEPLOYMENT_PHASE_DRAINING_OLD, pb.DEPLOYMENT_PHASE_CANARY)
            live = self.live if reads_live else None
            proxies = live.fresh_proxy_heartbeats() if live is not None else None
            nodes = list(live.fresh_node_heartbeats().values()) if live is not None else []
            transition = decide(self.view, d, self.clock.now(), self.timers, proxies, nodes)
            if transition is None:
                return None
            current.set_attribute("transition", transition.label)
            # Right after deciding: its writes expect the revisions just read. Refused, nothing (or an
            # unknown part, already caught up in the view) was written: the change that beat it wakes the
            # loop again and the step is decided afresh.
            [landed] = await self.commit_decisions([transition])
            if not landed:
                _refused.add(1)
                return None
        entered = deployment_of(transition)
        _transitions.add(1, {"to_phase": phase_label(entered.phase)})
        if entered.phase != d.phase or entered.canary.step != d.canary.step:
            log.info(
                "deployment %s: %s%s", deployment_id, transition.label, f" ({entered.error})" if entered.error else ""
            )
        return transition

    def seconds_until_due(self) -> float | None:
        """Until the earliest deadline the last pass had not reached yet: one that passed since (while the
        pass ran) is due at once; one the pass already saw was acted on, so it cannot cause a spin."""
        deadlines = (wake_at(self.view, d, self.timers) for d in self.live_deployments())
        upcoming = [t for t in deadlines if t is not None and t > self._pass_started_at]
        return max(0.0, min(upcoming) - self.clock.now()) if upcoming else None
