"""Health probes: which probe a spec means, and the HEALTHY/UNHEALTHY transitions (TCP and exec)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.health import ALIVE, EXEC, HTTP, TCP, HealthMonitor, Probe, min_healthy_time, probe_for
from shared.clock import Clock, FakeClock, RealClock
from tests.waiting import eventually

HEALTHY = pb.INSTANCE_STATE_HEALTHY
UNHEALTHY = pb.INSTANCE_STATE_UNHEALTHY


def test_probe_follows_the_spec_and_its_defaults() -> None:
    spec = pb.ServiceSpec()
    assert probe_for(spec, {"http": 8000}, min_healthy=3.0) == Probe(kind=ALIVE, min_healthy=3.0), "no port: none"

    spec.ports.add(name="db", container_port=5432, protocol=pb.PROTOCOL_TCP)
    spec.ports.add(name="web", container_port=80, protocol=pb.PROTOCOL_HTTP)
    spec.healthcheck.port = 80
    probe = probe_for(spec, {"db": 7001, "web": 7002})
    assert probe == Probe(kind=HTTP, port=7002, path="/", interval=10.0, timeout=5.0, grace=60.0, threshold=3)

    spec.healthcheck.port = 0
    assert probe_for(spec, {"db": 7001, "web": 7002}) == Probe(kind=TCP, port=7001)


@pytest.mark.parametrize(
    ("ports", "expected"),
    [
        ([("http", pb.PROTOCOL_HTTP)], Probe(kind=TCP, port=7001, min_healthy=2.0)),
        ([("db", pb.PROTOCOL_TCP), ("web", pb.PROTOCOL_UNSPECIFIED)], Probe(kind=TCP, port=7002, min_healthy=2.0)),
        ([("db", pb.PROTOCOL_TCP)], Probe(kind=ALIVE, min_healthy=2.0)),  # no HTTP port: running is the check
        ([], Probe(kind=ALIVE, min_healthy=2.0)),  # ports = [] (a worker)
    ],
)
def test_without_a_declared_check_an_http_port_is_probed_with_tcp(
    ports: list[tuple[str, int]], expected: Probe
) -> None:
    spec = pb.ServiceSpec()
    for name, protocol in ports:
        spec.ports.add(name=name, protocol=protocol)  # type: ignore[arg-type]
    host_ports = {"http": 7001} if ports[:1] == [("http", pb.PROTOCOL_HTTP)] else {"db": 7001, "web": 7002}
    assert probe_for(spec, host_ports, min_healthy=2.0) == expected


def test_the_minimum_healthy_time_is_the_specs_else_the_default() -> None:
    spec = pb.ServiceSpec()
    assert min_healthy_time(spec, 3.0) == 3.0
    spec.min_healthy_time.FromSeconds(0)  # set to zero: at once, not the default
    assert min_healthy_time(spec, 3.0) == 0.0
    spec.min_healthy_time.FromMilliseconds(10_500)
    assert min_healthy_time(spec, 3.0) == 10.5


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


async def test_a_process_without_a_check_is_healthy_only_after_the_minimum_time(tmp_path: Path) -> None:
    clock = FakeClock()
    async with monitoring(Probe(kind=ALIVE, min_healthy=3.0), tmp_path, clock) as states:
        await eventually(lambda: clock.sleepers == 1, what="waiting out the minimum")
        await clock.advance(2.9)
        await asyncio.sleep(0.05)
        assert states == []
        await clock.advance(0.1)
        await eventually(lambda: states == [HEALTHY], what="HEALTHY at 3 s")


async def test_an_implicit_tcp_probe_waits_for_the_port_and_the_minimum_time(tmp_path: Path) -> None:
    clock = FakeClock()
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    probe = Probe(kind=TCP, port=port, timeout=1.0, min_healthy=2.0)
    async with monitoring(probe, tmp_path, clock) as states:
        await eventually(lambda: clock.sleepers == 1, what="the first probe (refused)")
        await clock.advance(5.0)  # past the minimum, still not listening
        await eventually(lambda: clock.sleepers == 1, what="another refused probe")
        assert states == []
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        try:
            await clock.advance(0.02)
            await eventually(lambda: states == [HEALTHY], what="HEALTHY once it listens")
        finally:
            server.close()
            await server.wait_closed()
