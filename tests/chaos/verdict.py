"""The checks every chaos run ends with, and a one-line summary of what it did."""

from __future__ import annotations

import json

from zattera.v1 import types_pb2 as pb

from shared.deployments import is_terminal
from tests.chaos.workload import Run


async def verdict(run: Run) -> dict[str, object]:
    """Assert every promise of the run; returns the summary (also printed for RELIABILITY.md)."""
    run.collect_refusals()
    lost = await run.lost_acked_writes()
    view_gaps = await run.fresh_view_disagrees()
    not_terminal = [
        f"{d}: {pb.DeploymentPhase.Name(m.phase) if (m := run.watcher.deployment(d)) else 'missing'}"
        for d in run.deployments
        if (m := run.watcher.deployment(d)) is None or not is_terminal(m.phase)
    ]
    outcomes: dict[str, int] = {}
    for d in run.deployments:
        m = run.watcher.deployment(d)
        if m is not None:
            name = pb.DeploymentPhase.Name(m.phase).removeprefix("DEPLOYMENT_PHASE_")
            outcomes[name] = outcomes.get(name, 0) + 1
    summary: dict[str, object] = {
        "faults": run.stats.faults,
        "deployments": len(run.deployments),
        "outcomes": outcomes,
        "deploys": run.stats.deploys,
        "rollbacks": run.stats.rollbacks,
        "scale_changes": run.stats.scale_changes,
        "drains": run.stats.drains,
        "drains_completed": run.stats.drained,
        "agent_kills": run.stats.agent_kills,
        "invariant_checks": run.watcher.checks,
        "acked_writes_checked": len(run.acked),
        "refused_stale_writes": run.stats.refused_stale_writes,
        "frozen_leaders_stepped_down": run.stats.frozen_leaders_stepped_down,
        "audit": run.audit.counts(),
        "failover_s": {k: [round(x, 2) for x in v] for k, v in run.stats.failover_seconds.items()},
    }
    print("CHAOS SUMMARY", json.dumps(summary, sort_keys=True))
    crashed = run.fleet.crashed()
    assert not crashed, "a service crashed:\n" + "\n".join(crashed)
    assert not run.watcher.violations, "invariants violated:\n" + "\n".join(run.watcher.violations)
    fence = run.audit.violations()
    assert not fence, "a deposed leader's write landed:\n" + "\n".join(fence[:20])
    assert not lost, "acknowledged writes lost:\n" + "\n".join(lost)
    assert not view_gaps, "a fresh view missed acknowledged writes:\n" + "\n".join(view_gaps[:10])
    assert not not_terminal, "deployments not terminal:\n" + "\n".join(not_terminal)
    assert not run.errors, "\n".join(run.errors)
    assert run.watcher.checks > 0
    return summary
