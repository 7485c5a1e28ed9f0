"""Health probes: which probe a spec means, and the HEALTHY/UNHEALTHY transitions (TCP and exec)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from services.agent.health import EXEC, HTTP, TCP, HealthMonitor, Probe, probe_for
from shared.clock import Clock, FakeClock, RealClock
from tests.waiting import eventually

HEALTHY = pb.INSTANCE_STATE_HEALTHY
UNHEALTHY = pb.INSTANCE_STATE_UNHEALTHY


def test_probe_follows_the_spec_and_its_defaults() -> None:
    spec = pb.ServiceSpec()
    assert probe_for(spec, {"http": 8000}) is None, "no healthcheck: nothing to probe"

    spec.ports.add(name="db", container_port=5432, protocol=pb.PROTOCOL_TCP)
    spec.ports.add(name="web", container_port=80, protocol=pb.PROTOCOL_HTTP)
    spec.healthcheck.port = 80
    probe = probe_for(spec, {"db": 7001, "web": 7002})
    assert probe == Probe(kind=HTTP, port=7002, path="/", interval=10.0, timeout=5.0, grace=60.0, threshold=3)

    spec.healthcheck.port = 0
    assert probe_for(spec, {"db": 7001, "web": 7002}) == Probe(kind=TCP, port=7001)


@contextlib.asynccontextmanager
async def monitoring(probe: Probe, cwd: Path, clock: Clock | None = None) -> AsyncIterator[list[int]]:
    states: list[int] = []
    monitor = HealthMonitor(
        probe, states.append, cwd=cwd, env=dict(os.environ), startup_interval=0.02, clock=clock or RealClock()
    )
    task = asyncio.create_task(monitor.run())
    try:
        yield states
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_exec_probe_turns_unhealthy_after_threshold_and_recovers(tmp_path: Path) -> None:
    probe = Probe(kind=EXEC, command="test -f ok", interval=0.05, timeout=2.0, grace=0.0, threshold=2)
    async with monitoring(probe, tmp_path) as states:
        await eventually(lambda: states == [UNHEALTHY], what="UNHEALTHY after the grace")
        (tmp_path / "ok").touch()
        await eventually(lambda: states == [UNHEALTHY, HEALTHY], what="HEALTHY on success")
        (tmp_path / "ok").unlink()
        await eventually(lambda: states == [UNHEALTHY, HEALTHY, UNHEALTHY], what="UNHEALTHY again")


async def test_failures_within_grace_do_not_count(tmp_path: Path) -> None:
    probes = tmp_path / "probes"
    probes.touch()
    failing = Probe(kind=EXEC, command="echo probe >> probes; exit 1", interval=0.05, grace=30.0, threshold=1)
    async with monitoring(failing, tmp_path) as states:
        await eventually(lambda: len(probes.read_text().split()) >= 3, what="several failed probes")
        assert states == []


async def test_the_grace_is_measured_on_the_injected_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    probes = tmp_path / "probes"
    probes.touch()
    failing = Probe(kind=EXEC, command="echo probe >> probes; exit 1", interval=1.0, grace=30.0, threshold=1)

    def probed(times: int) -> bool:
        return clock.sleepers == 1 and len(probes.read_text().split()) == times

    async with monitoring(failing, tmp_path, clock) as states:
        await eventually(lambda: probed(1), what="the first probe")
        await clock.advance(31.0)  # wakes the second probe at 0.02 s: still within the grace
        await eventually(lambda: probed(2), what="the second probe")
        assert states == []
        await clock.advance(0.02)  # the third probe, 31.02 s after the start, counts
        await eventually(lambda: states == [UNHEALTHY], what="UNHEALTHY once the grace is over")


async def test_tcp_probe_passes_once_the_port_listens(tmp_path: Path) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with monitoring(Probe(kind=TCP, port=port, interval=0.05, timeout=1.0), tmp_path) as states:
            await eventually(lambda: states == [HEALTHY], what="HEALTHY")
    finally:
        server.close()
        await server.wait_closed()
