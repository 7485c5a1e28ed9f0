"""The short fault run of ``make test`` (the long one is ``test_chaos.py``, ``make chaos``).

Two replicas of every service on a 3-node NATS cluster (replicas=3); a red/green deploy with the
orchestrator and scheduler leaders SIGKILLed mid-flight; a stateful deploy while the nats-server that
leads the state stream is killed and restarted; a deploy with the orchestrator leader frozen (SIGSTOP)
past its lease TTL and resumed (it steps down; none of its writes lands); then a rollback, a scale change, a node drain
and an agent kill. The invariants are checked at every observed state throughout.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.chaos.verdict import verdict
from tests.chaos.workload import STATEFUL, WORKERS, Run


async def test_short_fault_run_keeps_every_invariant(tmp_path: Path) -> None:
    run = await Run.start(tmp_path, seed=7)
    try:
        await run.seed()
        await run.marker()

        first = await run.deploy("web-1")
        await run.kill_leader("orchestrator")
        await run.kill_leader("scheduler")
        await run.marker()

        stateful = await run.deploy(STATEFUL)
        await run.kill_nats_stream_leader(down_for=2.0)
        await run.marker()

        third = await run.deploy("web-2")
        await run.freeze_leader("orchestrator")
        await run.marker()

        for d in (first, stateful, third):
            assert d is not None
            await run.wait_terminal(d)
        back = await run.deploy("web-1", rollback=True)
        await run.scale("web-2", 3)
        spare = [w for w in WORKERS if w != run.volume_node()]
        await asyncio.gather(run.drain_and_return(spare[0], timeout=20), run.kill_agent(spare[1], down_for=2.0))
        if back is not None:
            await run.wait_terminal(back)
        await run.marker()

        summary = await verdict(run)
        assert summary["frozen_leaders_stepped_down"] == 1
        assert run.stats.nats_leader_kills == 1
    finally:
        await run.close()
