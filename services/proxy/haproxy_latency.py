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

``sample 1:N`` (``ZATTERA_PROXY_LATENCY_LOG_SAMPLE``) logs one request in N to bound the cost; request
and 5xx counts still come from HAProxy's stats (exact), only the latencies are sampled.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.proxy.haproxy_config import Plan
from services.proxy.stats import LATENCY_WINDOW, ReleaseCounters, percentiles3

log = logging.getLogger(__name__)

MAX_LINE = 256
"""Longer pending bytes without a newline are not a line of ours: dropped."""
SWITCHING_PROTOCOLS = 101
"""A WebSocket's ``Ta`` is the tunnel's whole life: not a request latency."""


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


class _Connection(asyncio.Protocol):
    """One forwarding connection of HAProxy's ring (one per worker: a reload adds one while the old drains)."""

    def __init__(self, receive: Callable[[bytes], None], open_: set[asyncio.BaseTransport]) -> None:
        self._receive = receive
        self._pending = b""
        self._open = open_
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._open.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._open.discard(self._transport)

    def data_received(self, data: bytes) -> None:
        end = data.rfind(b"\n")
        if end < 0:
            self._pending = b"" if len(self._pending) + len(data) > MAX_LINE else self._pending + data
            return
        whole, rest = data[: end + 1], data[end + 1 :]
        if self._pending:
            whole, self._pending = self._pending + whole, b""
        self._pending = rest if len(rest) <= MAX_LINE else b""
        self._receive(whole)


class LatencyLog:
    """The unix socket HAProxy's ring forwards to, feeding :class:`Latencies` with the owners of the plan
    HAProxy serves (``plan()``, read per batch of lines)."""

    def __init__(self, path: Path, plan: Callable[[], Plan]) -> None:
        self.path = path
        self._plan = plan
        self.latencies = Latencies()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.BaseTransport] = set()
        self._inode = 0
        self._owners_of: tuple[Plan, Owners] | None = None
        self._rebinding = asyncio.Lock()
        self._closed = False
        self.rebinds = 0
        """How often the socket was found gone and bound again."""

    def _owners(self) -> Owners:
        plan = self._plan()
        cached = self._owners_of
        if cached is None or cached[0] is not plan:
            cached = self._owners_of = (plan, Owners.of(plan))
        return cached[1]

    def _receive(self, data: bytes) -> None:
        self.latencies.feed(data, self._owners())

    async def start(self) -> None:
        """Listen (before HAProxy starts, so its first lines find the socket)."""
        self.path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _Connection(self._receive, self._connections), str(self.path)
        )
        self.path.chmod(0o600)
        self._inode = self.path.stat().st_ino

    async def ensure(self) -> None:
        """Bind the socket again when its file is gone or replaced (HAProxy reconnects by itself)."""
        async with self._rebinding:
            await self._ensure()

    def _bound(self) -> bool:
        try:
            return self._server is not None and self.path.stat().st_ino == self._inode
        except FileNotFoundError:
            return False

    async def _ensure(self) -> None:
        if self._closed or self._bound():
            return
        log.warning("haproxy latency log socket %s was gone: listening again", self.path)
        await self.stop()
        try:
            await self.start()
        except OSError as exc:
            log.error("haproxy latency log socket %s not bound (tried again next sample): %s", self.path, exc)
            return
        self.rebinds += 1

    async def close(self) -> None:
        """Stop for good (the engine stops): never bound again."""
        self._closed = True
        await self.stop()

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for transport in list(self._connections):
                transport.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1)
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_ino == self._inode:
                os.unlink(self.path)

    def percentiles(self, routed_envs: Collection[str]) -> Mapping[str, tuple[float, float, float]]:
        self.latencies.forget(routed_envs)
        return self.latencies.percentiles()
