"""Real latency percentiles on the HAProxy data plane (issues 40 and 41), from HAProxy's own request log.

HAProxy's stats keep only averages (``ttime``, ``rtime``); its request log has each request's times. The
frontend logs one compact line per answered request
(:data:`~services.proxy.haproxy_config.LATENCY_LOG_FORMAT`: backend, server, status, ``Ta`` — the total
active time in ms, from the request's first byte to the response's last, what the Python data plane
measures too) into a ``ring`` buffer (:data:`~services.proxy.haproxy_config.LATENCY_RING_SIZE` bytes),
which HAProxy forwards over a unix stream socket this process listens on (``Layout.latency_socket``),
newline-terminated (``format raw``). Nothing else is logged: no client address, no URL, no header
(``error-log-format "-"`` replaces the connection-error line, which names the client and the SNI).

Why a ring and a stream, not a datagram per request: a unix datagram socket queues at most
``net.unix.max_dgram_qlen`` messages (10 by default) before HAProxy's non-blocking send drops them, and a
datagram costs this process one wake-up and one ``recv`` each; the ring buffers the lines in HAProxy (the
oldest are overwritten when this process lags: never blocking the data plane), forwards them in batches,
and reconnects by itself after a reload (the new worker has its own ring and connection; the old one keeps
its own until it exits) or when this socket was gone (:meth:`LatencyLog.ensure` binds it again; lines
written meanwhile wait in the ring).

What the lines become is what the Python data plane keeps (:mod:`services.proxy.stats`): per env, the
latencies of the last :data:`~services.proxy.stats.LATENCY_WINDOW` logged requests (exact percentiles,
``ProxySample.latency_p50/p95/p99_ms``), kept in a fixed array of 4-byte integers per env (2 KiB); per
weighted (canary) server, the release's latency histogram of :data:`shared.canary.LATENCY_BOUNDS_MS`
under its step tag (:class:`~services.proxy.stats.ReleaseCounters`, at most ``KEEP_TAGS`` tags). Memory
is bounded by the routed envs and the tags; envs that leave the routes are forgotten.

A busy backend logs one request in N (:func:`log_every`: N a power of two keeping it at about
:data:`LOG_LINES_PER_BACKEND` lines a second; an entry of ``Layout.log_every_map`` set at run time from the
backend's rate; weighted backends, a canary's, always log every request): the percentiles of a busy env
come from its latest few seconds, and neither HAProxy nor this process pays a line per request
(PERFORMANCE.md, "Latency log"). ``sample 1:N`` (``ZATTERA_PROXY_LATENCY_LOG_SAMPLE``) logs one request in
N of every backend on top of that; request and 5xx counts still come from HAProxy's stats (exact), only the
latencies are sampled. The socket is read
every :data:`READ_INTERVAL` and before each sample, not per readable event (PERFORMANCE.md, "Latency log").

No library: the lines are four space-separated fields; syslog parsers would parse a format not used here,
and an HDR-histogram library would keep a shape the Python engine and the canary analysis do not share.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.proxy.haproxy_config import Plan
from services.proxy.stats import LATENCY_WINDOW, ReleaseCounters, percentiles3

log = logging.getLogger(__name__)

MAX_LINE = 256
"""Longer pending bytes without a newline are not a line of ours: dropped."""
SWITCHING_PROTOCOLS = 101
"""A WebSocket's ``Ta`` is the tunnel's whole life: not a request latency."""


LOG_LINES_PER_BACKEND = 128.0
"""About how many lines a second a busy backend logs (the window of an env's percentiles is
:data:`~services.proxy.stats.LATENCY_WINDOW` lines: a few seconds of a busy env)."""
LOG_EVERY_MAX = 4096


def log_every(
    rates: Mapping[str, float],
    exact: Collection[str],
    applied: Mapping[str, int],
    *,
    lines: float = LOG_LINES_PER_BACKEND,
) -> dict[str, int]:
    """Backend → log one request in N, for the backends whose requests/s (``rates``) are at least twice
    ``lines`` (none when ``lines`` is 0): the largest power of two keeping about ``lines`` a second logged, at most
    :data:`LOG_EVERY_MAX`; an ``applied`` N one step away from it is kept (no flapping at a boundary).
    Backends not in the result log every request, the ``exact`` ones always (a canary's histograms)."""
    every: dict[str, int] = {}
    for backend, rate in rates.items():
        if lines <= 0 or backend in exact or rate < 2 * lines:
            continue
        n = 1
        while n * 2 <= min(rate / lines, LOG_EVERY_MAX):
            n *= 2
        current = applied.get(backend, 1)
        every[backend] = current if current > 1 and current // 2 <= n <= current * 2 else n
    return every


def log_every_commands(path: Path, applied: Mapping[str, int], target: Mapping[str, int]) -> list[tuple[str, str, int]]:
    """The runtime commands taking the map at ``path`` from ``applied`` to ``target``, each with the backend
    and the N it leaves (0: the entry removed)."""
    commands = [
        (f"{'add' if name not in applied else 'set'} map {path} {name} {n}", name, n)
        for name, n in sorted(target.items())
        if applied.get(name) != n
    ]
    return commands + [(f"del map {path} {name}", name, 0) for name in sorted(applied.keys() - target.keys())]


class LogEvery:
    """Which backends log one request in N, as HAProxy has it (``Layout.log_every_map``)."""

    def __init__(self, path: Path, lines: float = LOG_LINES_PER_BACKEND) -> None:
        self.path = path
        self.lines = lines
        self.applied: dict[str, int] = {}

    def entries(self) -> list[tuple[str, str]]:
        """The map's entries as applied so far (what a reloaded HAProxy starts with)."""
        return [(name, str(n)) for name, n in sorted(self.applied.items())]

    async def update(
        self, rates: Mapping[str, float], exact: Collection[str], send: Callable[[str], Awaitable[object]]
    ) -> None:
        """Take HAProxy's map to :func:`log_every` of ``rates`` with ``send`` (a runtime command); what
        ``send`` raises leaves the rest for the next call."""
        target = log_every(rates, exact, self.applied, lines=self.lines)
        for line, name, n in log_every_commands(self.path, self.applied, target):
            await send(line)
            if n:
                self.applied[name] = n
            else:
                del self.applied[name]


@dataclass(frozen=True, slots=True)
class Owners:
    """Who a log line's backend and server belong to, for one plan."""

    env_of_backend: dict[bytes, str]
    release_of_server: dict[bytes, tuple[str, str, str]]
    """``b"<backend> <server>"`` → (env id, release id, step tag) of weighted (canary) servers."""

    @classmethod
    def of(cls, plan: Plan) -> Owners:
        return cls(
            {name.encode(): env_id for name, env_id in plan.env_of_backend.items()},
            {
                f"{backend.name} {server.name}".encode(): (backend.env_id, server.release_id, server.step_tag)
                for backend in plan.backends.values()
                for server in backend.servers
                if server.step_tag
            },
        )


class _Ring:
    """The last :data:`LATENCY_WINDOW` latencies (ms) of one env."""

    __slots__ = ("count", "latencies", "next", "percentiles")

    def __init__(self) -> None:
        self.latencies = array.array("I", bytes(4 * LATENCY_WINDOW))
        self.next = 0
        self.count = 0
        self.percentiles: tuple[float, float, float] | None = None
        """Cached until the next latency arrives."""

    def add(self, latency_ms: int) -> None:
        self.latencies[self.next] = latency_ms
        self.next = (self.next + 1) % LATENCY_WINDOW
        self.count = min(self.count + 1, LATENCY_WINDOW)
        self.percentiles = None

    def p50_p95_p99(self) -> tuple[float, float, float]:
        if self.percentiles is None:
            self.percentiles = percentiles3(list(self.latencies[: self.count]))
        return self.percentiles


class Latencies:
    """The histograms the log lines feed (pure: bytes in, percentiles and release histograms out)."""

    def __init__(self) -> None:
        self._envs: dict[str, _Ring] = {}
        self.releases = ReleaseCounters()
        self.lines = 0
        """Lines counted (an env's or a weighted server's request) since start."""

    def feed(self, data: bytes, owners: Owners) -> None:
        """Whole lines (``data`` ends at a newline)."""
        env_of, release_of = owners.env_of_backend, owners.release_of_server
        envs = self._envs
        for line in data.split(b"\n"):
            parts = line.split(b" ")
            if len(parts) != 4:  # the four fields of LATENCY_LOG_FORMAT
                continue
            env_id = env_of.get(parts[0])
            if env_id is None:
                continue  # the hold and no-route backends, a request that found no backend, an error line
            try:
                status, latency = int(parts[2]), int(parts[3])
            except ValueError:
                continue
            if latency < 0 or status == SWITCHING_PROTOCOLS:
                continue
            ring = envs.get(env_id)
            if ring is None:
                ring = envs[env_id] = _Ring()
            ring.add(latency)
            self.lines += 1
            if release_of:
                owner = release_of.get(parts[0] + b" " + parts[1])
                if owner is not None:
                    self.releases.count_release(*owner, status, latency)

    def percentiles(self) -> dict[str, tuple[float, float, float]]:
        """Env id → (p50, p95, p99) over its last logged requests."""
        return {env_id: ring.p50_p95_p99() for env_id, ring in self._envs.items() if ring.count}

    def forget(self, routed_envs: Collection[str]) -> None:
        """Envs no longer routed are dropped (memory stays bounded by the routes)."""
        for env_id in [e for e in self._envs if e not in routed_envs]:
            del self._envs[env_id]


class _Lines:
    """Bytes of one connection cut at newlines: what ends without one waits for the next read."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""

    def whole(self, data: bytes) -> bytes:
        """The whole lines of ``pending + data`` (b"" if none); keeps the rest (dropped past MAX_LINE)."""
        end = data.rfind(b"\n")
        if end < 0:
            self.pending = b"" if len(self.pending) + len(data) > MAX_LINE else self.pending + data
            return b""
        whole, rest = data[: end + 1], data[end + 1 :]
        if self.pending:
            whole, self.pending = self.pending + whole, b""
        self.pending = rest if len(rest) <= MAX_LINE else b""
        return whole


READ_INTERVAL = 0.1
"""Seconds between two reads of the log connections. Not a read per readable event: at a few thousand
requests per second that was one event-loop wake-up per line (~12 µs of the proxy process per request,
canary_bench); every 100 ms, one read takes all the lines the kernel (and HAProxy's ring) kept meanwhile."""
READ_BYTES = 1 << 18


class LatencyLog:
    """The unix socket HAProxy's ring forwards to, feeding :class:`Latencies` with the owners of the plan
    HAProxy serves (``plan()``, read per batch of lines). Plain non-blocking sockets read every
    :data:`READ_INTERVAL` and before each sample (:meth:`drain`): no event-loop callback per line."""

    def __init__(self, path: Path, plan: Callable[[], Plan], *, interval: float = READ_INTERVAL) -> None:
        self.path = path
        self._plan = plan
        self.interval = interval
        self.latencies = Latencies()
        self._listener: socket.socket | None = None
        self._connections: dict[socket.socket, _Lines] = {}
        self._reader: asyncio.Task[None] | None = None
        self._inode = 0
        self._owners_of: tuple[Plan, Owners] | None = None
        self._closed = False
        self.rebinds = 0
        """How often the socket was found gone and bound again."""

    def _owners(self) -> Owners:
        plan = self._plan()
        cached = self._owners_of
        if cached is None or cached[0] is not plan:
            cached = self._owners_of = (plan, Owners.of(plan))
        return cached[1]

    async def start(self) -> None:
        """Listen (before HAProxy starts, so its first lines find the socket) and read periodically."""
        self._bind()
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_periodically())

    def _bind(self) -> None:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            self.path.chmod(0o600)
            listener.listen(16)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._inode = self.path.stat().st_ino

    async def _read_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.drain()

    def drain(self) -> None:
        """Accept HAProxy's new connections, read everything the kernel holds, count the lines."""
        listener = self._listener
        if listener is not None:
            while True:
                try:
                    connection, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log.debug("haproxy latency log: accept failed: %s", exc)
                    break
                connection.setblocking(False)
                self._connections[connection] = _Lines()
        owners: Owners | None = None
        for connection, lines in list(self._connections.items()):
            while True:
                try:
                    data = connection.recv(READ_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    data = b""
                if not data:  # HAProxy closed it (an old worker gone, a restart)
                    connection.close()
                    del self._connections[connection]
                    break
                whole = lines.whole(data)
                if whole:
                    owners = owners or self._owners()
                    self.latencies.feed(whole, owners)

    def _bound(self) -> bool:
        try:
            return self._listener is not None and self.path.stat().st_ino == self._inode
        except FileNotFoundError:
            return False

    async def ensure(self) -> None:
        """Bind the socket again when its file is gone or replaced (HAProxy reconnects by itself)."""
        if self._closed or self._bound():
            return
        log.warning("haproxy latency log socket %s was gone: listening again", self.path)
        self._unbind()
        try:
            self._bind()
        except OSError as exc:
            log.error("haproxy latency log socket %s not bound (tried again next sample): %s", self.path, exc)
            return
        self.rebinds += 1

    def _unbind(self) -> None:
        """Close the listener and its connections (their unread lines stay in HAProxy's ring)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for connection in self._connections:
            connection.close()
        self._connections.clear()
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_ino == self._inode:
                os.unlink(self.path)

    async def stop(self) -> None:
        """Stop listening (the lines HAProxy writes meanwhile wait in its ring: :meth:`ensure` listens again)."""
        self._unbind()

    async def close(self) -> None:
        """Stop for good (the engine stops): never bound again."""
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        self._unbind()

    def percentiles(self, routed_envs: Collection[str]) -> Mapping[str, tuple[float, float, float]]:
        """Env id → (p50, p95, p99) with every line HAProxy has sent so far counted."""
        self.drain()
        self.latencies.forget(routed_envs)
        return self.latencies.percentiles()
