"""The long fault suite (``make chaos``): a scripted workload of 20 deployments (red/green, stateful,
rollbacks) with scale changes, node drains and agent kills, while a fault injector SIGKILLs the leader of
every loop, freezes leaders past their lease TTL, and kills the nats-server leading the state stream,
at random moments. Seeded: ``ZATTERA_CHAOS_SEED`` picks the run; ``ZATTERA_CHAOS_DEPLOYS`` its size.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tests.chaos.cluster import LOOPS, NatsCluster
from tests.chaos.verdict import verdict
from tests.chaos.workload import STATEFUL, STATELESS, WORKERS, Run
from tests.waiting import eventually

pytestmark = pytest.mark.chaos

SEED = int(os.environ.get("ZATTERA_CHAOS_SEED", "20261129"))
DEPLOYS = int(os.environ.get("ZATTERA_CHAOS_DEPLOYS", "20"))


@pytest.mark.timeout(900)
async def test_twenty_deploys_under_random_faults(tmp_path: Path) -> None:
    run = await Run.start(tmp_path, seed=SEED)
    try:
        await run.seed()
        await run.marker()
        # Every loop's leader is killed at least once, in a random order, then random faults follow.
        loops = [loop for group in LOOPS.values() for loop in group]
        run.rng.shuffle(loops)
        done = asyncio.Event()

        async def inject() -> None:
            await run.kill_nats_stream_leader(run.rng.uniform(1.0, 3.0))
            for loop in loops:
                if done.is_set():
                    break
                await run.kill_leader(loop)
                await asyncio.sleep(run.rng.uniform(0.2, 2.0))  # random fault timing (the workload)
            await run.freeze_leader("orchestrator")
            await run.freeze_leader("scheduler")
            while not done.is_set():
                await run.random_fault()
                await asyncio.sleep(run.rng.uniform(0.5, 3.0))

        async def operate() -> None:
            envs = [*STATELESS, STATEFUL]
            for i in range(DEPLOYS):
                env_id = envs[i % len(envs)]
                rollback = i % 5 == 4
                d = await run.deploy(env_id, rollback=rollback)
                if i % 4 == 1:
                    await run.scale(run.rng.choice(STATELESS), run.rng.choice([1, 2, 3]))
                if i % 6 == 3:
                    spare = [w for w in WORKERS if w != run.volume_node()]
                    await run.drain_and_return(run.rng.choice(spare), timeout=20)
                if i % 7 == 5:
                    asyncio.get_running_loop().create_task(run.kill_agent(run.rng.choice(WORKERS), 3.0))
                if d is not None:
                    await run.wait_terminal(d)
                await run.marker()

        injector = asyncio.create_task(inject())
        try:
            await operate()
        finally:
            done.set()
            await asyncio.wait_for(injector, 120)
        for d in run.deployments:
            await run.wait_terminal(d)
        summary = await verdict(run)
        assert run.stats.deploys + run.stats.rollbacks >= DEPLOYS * 0.8
        assert summary["refused_stale_writes"] >= 1  # type: ignore[operator]
        assert all(loop in run.stats.failover_seconds for loop in loops)
    finally:
        await run.close()


@pytest.mark.timeout(180)
async def test_a_service_started_without_jetstream_quorum_waits_instead_of_exiting(tmp_path: Path) -> None:
    """Regression: a service (re)started while the NATS cluster had no stream leader died on a provisioning
    timeout (``shared/service.py``); it must wait and come up once JetStream answers."""
    nats = NatsCluster(tmp_path / "nats").start()
    run_fleet = None
    try:
        await nats.provision()
        nats.kill(1)
        nats.kill(2)
        from tests.chaos.cluster import Fleet

        run_fleet = Fleet(nats.urls, tmp_path / "logs")
        proc = run_fleet.start("orchestrator")
        # Provisioning or loading its view, whichever asks JetStream first: it waits and says so.
        await eventually(lambda: "; retrying in" in proc.log.read_text(errors="replace"), 60, "a retry")
        assert proc.alive(), proc.log.read_text(errors="replace")[-3000:]
        started = time.monotonic()
        nats.restart(1)
        nats.restart(2)
        await eventually(lambda: "acquired by" in proc.log.read_text(errors="replace"), 60, "the lease, later")
        assert proc.alive()
        assert time.monotonic() - started < 60
    finally:
        if run_fleet is not None:
            run_fleet.stop_all()
        nats.stop()
