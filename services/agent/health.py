"""Health checks of running instances (``ServiceSpec.healthcheck``) → HEALTHY / UNHEALTHY.

* No healthcheck declared: the instance is HEALTHY once its process has run for the minimum healthy time
  (``ServiceSpec.min_healthy_time``, else the agent's default; a process that exits sooner is a failed
  start, never a healthy replica) and, when the env has an HTTP port, accepts TCP connections on it (an
  implicit probe: TCP, not HTTP, since an app's ``/`` may rightly answer 404 or 401; traffic is routed to
  the replica only once it listens). With no HTTP port, running long enough is the whole check.
* HTTP: ``GET <path>`` on the instance's port, healthy on a 2xx/3xx status. TCP: a connection opens.
  EXEC: the shell command exits 0 (run in the instance's directory with its environment).
  Type UNSPECIFIED means HTTP when the probed port is an HTTP port, else TCP.
* The probed port is the declared port whose ``container_port`` equals ``healthcheck.port``, else the
  first declared port; the process runtime has no port mapping, so the probe targets the host port the
  instance was given.
* Defaults: interval 10 s, timeout 5 s, grace 60 s, threshold 3. Within the grace period and until the
  first success the probe runs every ``startup_interval`` (short), so a fresh instance turns HEALTHY as
  soon as it answers; afterwards every ``interval``.
* The first success → HEALTHY. Failures count only once the grace period has passed or after a first
  success; ``threshold`` consecutive counted failures → UNHEALTHY; a later success → HEALTHY again. An
  UNHEALTHY process is not restarted (the orchestrator decides what to do with it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from google.protobuf.duration_pb2 import Duration
from zattera.v1 import types_pb2 as pb

from shared.clock import Clock
from shared.settings import DEFAULTS, settings
from shared.subprocesses import run_shell

DEFAULT_INTERVAL = 10.0
DEFAULT_TIMEOUT = 5.0
DEFAULT_THRESHOLD = 3
HTTP = "http"
TCP = "tcp"
EXEC = "exec"
ALIVE = "alive"
"""No probe: the process running (for the minimum healthy time) is the check."""
LOOPBACK = "127.0.0.1"
_HTTP_PROTOCOLS = (pb.PROTOCOL_UNSPECIFIED, pb.PROTOCOL_HTTP)


def seconds(duration: Duration, default: float) -> float:
    value = duration.seconds + duration.nanos / 1e9
    return value if value > 0 else default


@dataclass(frozen=True)
class Probe:
    kind: str
    port: int = 0
    host: str = LOOPBACK
    """Where the instance listens: the node's bind address (``ZATTERA_BIND_ADDR``)."""
    path: str = "/"
    command: str = ""
    interval: float = DEFAULT_INTERVAL
    timeout: float = DEFAULT_TIMEOUT
    grace: float = DEFAULTS.health_default_grace
    threshold: int = DEFAULT_THRESHOLD
    min_healthy: float = 0.0
    """Seconds the instance must have run before a passing probe makes it HEALTHY (no declared check)."""


def _probed_port(spec: pb.ServiceSpec, wanted: int) -> pb.PortSpec | None:
    for port in spec.ports:
        if wanted and port.container_port == wanted:
            return port
    return spec.ports[0] if spec.ports else None


def min_healthy_time(spec: pb.ServiceSpec, default: float) -> float:
    """The spec's minimum healthy time in seconds; ``default`` when it sets none (0 is a value: at once)."""
    if spec.HasField("min_healthy_time"):
        return max(0.0, spec.min_healthy_time.seconds + spec.min_healthy_time.nanos / 1e9)
    return default


def probe_for(
    spec: pb.ServiceSpec, host_ports: Mapping[str, int], *, host: str = LOOPBACK, min_healthy: float = 0.0
) -> Probe:
    """The probe of a release's spec with the instance's host ports on ``host`` (the address the instance
    was told to bind). Without a declared healthcheck: a TCP probe of the first HTTP port the spec declares
    (none declared: nothing to probe, ``ALIVE``), HEALTHY no sooner than ``min_healthy`` seconds after the
    start."""
    if not spec.HasField("healthcheck"):
        http = next((p for p in spec.ports if p.protocol in _HTTP_PROTOCOLS), None)
        if http is None:
            return Probe(kind=ALIVE, host=host, min_healthy=min_healthy)
        port = host_ports.get(http.name or "http") or next(iter(host_ports.values()), 0)
        return Probe(kind=TCP, port=port, host=host, min_healthy=min_healthy)
    check = spec.healthcheck
    declared = _probed_port(spec, check.port)
    port_name = (declared.name or "http") if declared is not None else "http"
    port = host_ports.get(port_name) or next(iter(host_ports.values()), 0)
    kind = {pb.HEALTH_CHECK_TYPE_HTTP: HTTP, pb.HEALTH_CHECK_TYPE_TCP: TCP, pb.HEALTH_CHECK_TYPE_EXEC: EXEC}.get(
        check.type, ""
    )
    if not kind:
        is_http = declared is None or declared.protocol in (pb.PROTOCOL_UNSPECIFIED, pb.PROTOCOL_HTTP)
        kind = HTTP if is_http else TCP
    return Probe(
        kind=kind,
        port=port,
        host=host,
        path=check.path or "/",
        command=check.command,
        interval=seconds(check.interval, DEFAULT_INTERVAL),
        timeout=seconds(check.timeout, DEFAULT_TIMEOUT),
        grace=seconds(check.grace_period, settings().health_default_grace),
        threshold=check.unhealthy_threshold or DEFAULT_THRESHOLD,
    )


async def check_http(host: str, port: int, path: str) -> bool:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nUser-Agent: zattera-agent\r\n\r\n".encode())
        await writer.drain()
        status_line = await reader.readline()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    parts = status_line.split()
    return len(parts) >= 2 and parts[1].isdigit() and 200 <= int(parts[1]) < 400


async def check_tcp(host: str, port: int) -> bool:
    _, writer = await asyncio.open_connection(host, port)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def check_exec(command: str, cwd: Path, env: Mapping[str, str]) -> bool:
    return await run_shell(command, cwd=cwd, env=env) == 0


@dataclass(eq=False)
class HealthMonitor:
    """Probes one instance until cancelled; calls ``on_state`` when its health state changes."""

    probe: Probe
    on_state: Callable[[int], None]
    _: KW_ONLY
    cwd: Path
    env: Mapping[str, str]
    startup_interval: float
    """Between probes while the start grace lasts (never longer than the probe's own interval)."""
    clock: Clock
    exec_check: Callable[[str], Awaitable[bool]] | None = None
    state: int = field(init=False, default=pb.INSTANCE_STATE_UNSPECIFIED)

    async def check_once(self) -> bool:
        probe = self.probe
        if probe.kind == ALIVE:
            return True
        try:
            async with asyncio.timeout(probe.timeout):
                if probe.kind == EXEC and self.exec_check is not None:
                    return await self.exec_check(probe.command)
                if probe.kind == EXEC:
                    return await check_exec(probe.command, self.cwd, self.env)
                if probe.kind == TCP:
                    return await check_tcp(probe.host, probe.port)
                return await check_http(probe.host, probe.port, probe.path)
        except (OSError, TimeoutError, ValueError):
            return False

    async def run(self) -> None:
        started = self.clock.now()
        healthy_from = started + self.probe.min_healthy
        ever_healthy = False
        failures = 0
        while True:
            in_grace = not ever_healthy and self.clock.now() - started < self.probe.grace
            if await self.check_once():
                ever_healthy = True
                failures = 0
                early = healthy_from - self.clock.now()
                if early > 0 and self.state != pb.INSTANCE_STATE_HEALTHY:
                    await self.clock.sleep(min(early, self.probe.interval))  # passing, not up long enough
                    continue
                self._set(pb.INSTANCE_STATE_HEALTHY)
                if self.probe.kind == ALIVE:
                    return  # nothing more to watch: the supervisor sees the exit
            elif not in_grace:
                failures += 1
                if failures >= self.probe.threshold:
                    self._set(pb.INSTANCE_STATE_UNHEALTHY)
            interval = min(self.startup_interval, self.probe.interval) if in_grace else self.probe.interval
            await self.clock.sleep(interval)

    def _set(self, state: int) -> None:
        if state != self.state:
            self.state = state
            self.on_state(state)
