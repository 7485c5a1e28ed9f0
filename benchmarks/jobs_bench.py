"""Cron scheduling delay: ``python -m benchmarks.jobs_bench [--full]``.

1,000 cron entries (50 envs × 20 entries, ``* * * * *``) fall due in the same minute. The jobs loop leads
on an embedded nats-server (store on the real disk) with a fake clock held one second before the slot;
simulated agents (``tests/agent_sim.py``) report each job assignment RUNNING as soon as they see it, as an
agent does right before it spawns the process. The clock is moved onto the slot and the figure is, per
run, the wall time from that moment to the RUNNING report landing: the loop's decision (1,000 slots,
1,000 placements), its fenced writes, the agents seeing the assignments and their reports. The process
spawn itself is not included there; a second figure covers it: a real agent (in-process, real processes)
runs the jobs of 100 entries (``--full``: 300) due at the same slot, and the delay is from the slot to
the agent's own ``started_at`` of each process. Quick and full mode both use 1,000 entries for the first
figure; ``--full`` repeats its slot 3 times. Beside that wall time, two figures the machine's load does not
move, from the slot until every job succeeded: the ``fsync`` calls made in this process (the agent runs in
it) and its CPU time, each per process started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main, embedded_server, percentile, row
from services.agent.agent import Agent
from services.agent.settings import AgentSettings
from services.scheduler.jobs import JobsLoop
from shared import jobs as J
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import connect
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests import factories as f
from tests.agent_sim import RUNNING, AgentSim

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

ENVS = 50
ENTRIES_PER_ENV = 20
NODES = 20
SLOT = 1_893_456_000.0  # 2030-01-01 00:00:00 UTC, a minute boundary
TIMEOUT = 120.0


def _env(index: int, slot: float, entries: int = ENTRIES_PER_ENV) -> tuple[pb.Environment, pb.Release]:
    env_id, release_id = f"e{index:03d}", f"r{index:03d}"
    env = f.env(env_id, min_replicas=0, active_release_id=release_id)
    for n in range(entries):
        entry = env.service.cron.add(name=f"task-{n}", schedule="* * * * *", command="true")
        entry.since.FromNanoseconds(int((slot - 30) * 1e9))
    return env, f.release(release_id, env_id, cpu=10, mem=16)


async def _one_slot(nats_url: str, slot: float) -> list[float]:
    conn = await connect(nats_url, name="jobs-bench")
    await provision(conn.js)
    view = StateView(conn, name="jobs-bench")
    await view.start()
    agents = await AgentSim(conn, name="agents").start()
    agents.other_state = RUNNING
    clock = FakeClock(start=slot - 1)
    loop = JobsLoop(LoopDeps(conn, view, clock), tick=3600)
    leading: asyncio.Task[None] | None = None
    try:
        writer = Writer(conn, view)
        seed = writer.txn("seed")
        for n in range(NODES):
            seed.put(f.node(f"n{n:02d}", cpu=64_000, mem=256_000))
        await writer.commit(seed)
        await writer.commit_many(
            [writer.txn("seed").put(e).put(r) for e, r in map(lambda i: _env(i, slot), range(ENVS))]
        )
        leading = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="bench", ttl=30))
        deadline = time.monotonic() + TIMEOUT
        while loop.seconds_until_due() is None or not clock.sleepers:
            if time.monotonic() > deadline:
                raise TimeoutError("the jobs loop did not settle before the slot")
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        await clock.advance(1)
        expected = ENVS * ENTRIES_PER_ENV
        while sum(1 for r in agents.reports if r.state == RUNNING) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError("not every job started")
            await asyncio.sleep(0.01)
        jobs = [a for a in agents.view.assignments() if a.job_id]
        assert len(jobs) == expected and len(view.all(K.JOB)) == expected
        return [(r.at - started) * 1000 for r in agents.reports if r.state == RUNNING]
    finally:
        if leading is not None:
            leading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leading
        await agents.stop()
        await view.stop()
        await conn.close()


@contextlib.contextmanager
def _counting_fsyncs() -> Iterator[list[int]]:
    """The ``os.fsync`` calls made in this process meanwhile, from any thread (one counter in a list)."""
    count = [0]
    real = os.fsync

    def fsync(fd: FileDescriptorLike) -> None:
        count[0] += 1
        real(fd)

    os.fsync = fsync
    try:
        yield count
    finally:
        os.fsync = real


async def _real_agent_slot(nats_url: str, entries: int) -> tuple[list[float], float, float]:
    """Slot → the agent's ``started_at`` of each job process, one real agent on this machine; and, per
    process, the fsync calls and the CPU milliseconds of this process from the slot until all succeeded."""
    conn = await connect(nats_url, name="jobs-bench")
    await provision(conn.js)
    view = StateView(conn, name="jobs-bench")
    await view.start()
    now = time.time()
    slot = float(int(now) // 60 * 60 + 60)
    clock = FakeClock(start=slot - 1)
    loop = JobsLoop(LoopDeps(conn, view, clock), tick=3600)
    leading: asyncio.Task[None] | None = None
    agent_task: asyncio.Task[None] | None = None
    agent_conn = await connect(nats_url, name="jobs-bench-agent")
    with tempfile.TemporaryDirectory(prefix="zattera-jobs-bench-agent-") as data_dir:
        try:
            settings = AgentSettings(node_id="n1", stop_on_exit=True)
            agent = Agent(agent_conn, settings, Path(data_dir))
            agent_task = asyncio.create_task(agent.run())
            env, release = _env(0, slot, entries)
            release.image_ref = "exec:true"
            release.service.resources.cpu_millis = release.service.resources.memory_mb = 1
            writer = Writer(conn, view)
            await writer.commit(writer.txn("seed").put(env).put(release))
            deadline = time.monotonic() + TIMEOUT
            while view.node("n1") is None:
                if agent_task.done() or time.monotonic() > deadline:
                    agent_task.result()
                    raise TimeoutError("the agent did not register")
                await asyncio.sleep(0.01)
            leading = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="bench", ttl=30))
            while loop.seconds_until_due() is None or not clock.sleepers:
                if time.monotonic() > deadline:
                    raise TimeoutError("the jobs loop did not settle before the slot")
                await asyncio.sleep(0.01)
            started_wall, started_cpu = time.time(), time.process_time()
            with _counting_fsyncs() as fsyncs:
                await clock.advance(1)
                while sum(1 for j in view.jobs() if j.status == J.SUCCEEDED) < entries:
                    failed = [j.message for j in view.jobs() if j.status == J.FAILED]
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"jobs did not all succeed: {failed[:3]}")
                    await asyncio.sleep(0.02)
            cpu_ms = (time.process_time() - started_cpu) * 1000
            delays = [(j.started_at.ToNanoseconds() / 1e9 - started_wall) * 1000 for j in view.jobs()]
            return delays, fsyncs[0] / entries, cpu_ms / entries
        finally:
            for task in (leading, agent_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await agent_conn.close()
            await view.stop()
            await conn.close()


async def _run(quick: bool) -> list[dict[str, object]]:
    delays: list[float] = []
    for _ in range(1 if quick else 3):
        with embedded_server("zattera-jobs-bench-") as server:
            delays.extend(await _one_slot(server.url, SLOT))
    real_entries = 100 if quick else 300
    with embedded_server("zattera-jobs-bench-") as server:
        spawned, fsyncs, cpu_ms = await _real_agent_slot(server.url, real_entries)
    entries = f"{ENVS * ENTRIES_PER_ENV:,} entries due in the same minute"
    anchor = "Kubernetes CronJob controller: 10 s sync; Nomad periodic: launches at the slot"
    return [
        row(f"cron slot → job RUNNING, p50 ({entries})", percentile(delays, 50), "ms", "p50 ≤ 1 s", anchor),
        row(f"cron slot → job RUNNING, p99 ({entries})", percentile(delays, 99), "ms", "p99 ≤ 5 s", anchor),
        row(
            f"cron slot → process started, p50 ({real_entries} entries, one real agent)", percentile(spawned, 50), "ms"
        ),
        row(
            f"cron slot → process started, p99 ({real_entries} entries, one real agent)", percentile(spawned, 99), "ms"
        ),
        row("fsync calls per process started (agent, jobs loop and bench in one process)", fsyncs, ""),
        row("CPU per process started (agent, jobs loop and bench in one process)", cpu_ms, "ms"),
    ]


def run(quick: bool = True) -> list[dict[str, object]]:
    return asyncio.run(_run(quick))


def main() -> None:
    bench_main("Jobs", run, __doc__, "repeat the slot 3 times")


if __name__ == "__main__":
    main()
