"""The proxy process's core: HTTP server, route following, heartbeats, and the request pipeline composed
from ``services/proxy/pipeline/`` (one middleware per module, in its ``ORDER``): route match (404) → IP
allowlist (403) → HTTPS redirect (308, when the route asks for it) → per-client rate limit (429) → basic auth
(401) → body cap (413) → endpoint choice (sticky, then P2C under the cap; hold-and-activate when cold or
full: 503/504, else 502) → forward with in-flight accounting (502 on upstream error). Every error body is
``{"error": "<msg>"}`` as JSON.

Deliberate choices:

* no TLS listener here (HTTPS is HAProxy's: docs/ingress.md): a route without middleware is not
  redirected, one with ``redirect_https`` is, unless ``X-Forwarded-Proto: https`` says a TLS terminator in
  front already did TLS; no gzip middleware;
* a declared body above ``middleware.max_body_bytes`` is refused up front with 413 (not cut
  mid-stream with a 502); an undeclared (chunked) one is still cut at the cap;
* an upstream that refuses the connection is retried on another healthy endpoint of the route, each at most
  once, and a GET or HEAD whose upstream closed without answering is sent again (``pipeline/forward.py``).

The route table follows the route client: built from the cached snapshot before any network activity
(so a restarted proxy serves the last routes with the control plane down), rebuilt on every accepted
snapshot, and each rebuild wakes held requests. NATS is connected in the background, with retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.activator import Holds
from services.proxy.auth import BasicAuth
from services.proxy.balancer import Balancer
from services.proxy.haproxy_stats import merge_samples
from services.proxy.ratelimit import RateLimiter
from services.proxy.routing import RouteTable
from services.proxy.settings import ROUTES_CACHE_FILE, ProxySettings
from services.proxy.stats import ProxyStats
from shared.acmechallenge import ChallengeAnswers
from shared.activation import INVALID_ARGUMENT, NOT_FOUND, ActivateError, request_activation
from shared.certclient import CertClient
from shared.connection import Connection
from shared.live import publish_proxy_heartbeat
from shared.metrics import RequestSeries
from shared.process import connect_with_retry
from shared.routeclient import RouteClient
from shared.routewire import same_cluster
from shared.skew import Component, Verdict, judge_peer
from shared.tasks import cancel_and_wait
from shared.version import VERSION

if TYPE_CHECKING:
    from services.proxy.http_serving import HTTPServing

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Proxy:
    cfg: ProxySettings
    _: KW_ONLY
    nats_url: str
    cache_dir: Path
    metrics: bool = False
    behind_engine: bool = False
    """Serving for an engine in front (HAProxy): the client is the last ``X-Forwarded-For`` value."""

    def __post_init__(self) -> None:
        self.snapshot_listeners: list[Callable[[cpb.RouteSnapshot], None]] = []
        self.sample_sources: list[Callable[[], Awaitable[dict[str, cpb.ProxySample]]]] = []
        """Other data paths' per-env samples, merged into this proxy's heartbeat."""
        self.traffic_sources: list[Callable[[], list[cpb.ReleaseTraffic]]] = []
        """Other data paths' per-release counters of weighted (canary) routes (issue 41)."""
        self.drain_sources: list[Callable[[], Awaitable[tuple[dict[str, int], bool]]]] = []
        """Other data paths' in-flight counts to endpoints no longer routed (env id → count), and whether
        those counts are complete: added to the heartbeat's ``old_inflight`` / ``drain_counts``."""
        self.served: Callable[[], tuple[int, cpb.ClusterIdentity]] = lambda: (self.table.version, self.table.cluster)
        """The routes version the data plane serves, and their cluster (an engine in front may lag the Python
        table)."""
        self.public_ports: Callable[[], tuple[int, int]] = lambda: (self._listening, 0)
        """Where clients reach this proxy: (HTTP port, HTTPS port; 0 = none), reported in the heartbeat so that
        the URLs the CLI and console show carry the port that works (an engine in front reports its own)."""
        self.requests = RequestSeries()
        """Per-env request durations (metrics on), recorded by the HTTP side and exported in the heartbeat."""
        self.proxy_id = self.cfg.proxy_id or socket.gethostname()
        self.routes = RouteClient(self.cache_dir / ROUTES_CACHE_FILE, node_id=self.cfg.node_id)
        self.table = RouteTable(self.routes.current)
        self._control_version: str | None = None
        self.balancer = Balancer(self.cfg.node_id)
        self.limiter = RateLimiter()
        self.basic_auth = BasicAuth()
        self.stats = ProxyStats()
        self.holds = Holds(
            self._activate,
            max_held_per_env=self.cfg.max_held_per_env,
            hold_timeout=self.cfg.hold_timeout,
            max_body_bytes=self.cfg.max_held_body_bytes,
        )
        self.challenges = ChallengeAnswers()
        self.certificates: CertClient | None = None
        """Set by a TLS engine in front: followed on every connection, like the routes."""
        self.conn: Connection | None = None
        self._connected = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.http: HTTPServing | None = None
        """The HTTP server and the request pipeline (``http_serving.py``, aiohttp): behind an engine, loaded at
        the first connection (:meth:`start`)."""
        self._socket: socket.socket | None = None
        self._opening: asyncio.Task[None] | None = None
        self._listening = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        assert self._listening, "start() first"
        return self._listening

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def start(self) -> None:
        """Serve at once from the cached routes; connect to NATS in the background. Behind an engine (HAProxy)
        the handler sees only held, basic-auth and ACME requests, which a node at idle has none of: the socket
        listens at once and the HTTP server (aiohttp, ~11 MB resident) is loaded when the first connection
        arrives, which waits in the backlog meanwhile (PERFORMANCE.md "A lighter node")."""
        if self.behind_engine:
            self._socket = socket.create_server((self.cfg.host, self.cfg.port), backlog=128)
            self._socket.setblocking(False)
            self._listening = int(self._socket.getsockname()[1])
            asyncio.get_running_loop().add_reader(self._socket, self._first_connection)
        else:
            await self._serve_http(None)
        self._tasks = [
            asyncio.create_task(self._follow_routes()),
            asyncio.create_task(self._connect_and_report()),
        ]
        log.info(
            "proxy %s: listening on %s:%d (routes version %d)",
            self.proxy_id,
            self.cfg.host,
            self.port,
            self.table.version,
        )

    async def wait_connected(self) -> None:
        await self._connected.wait()

    async def stop(self) -> None:
        """Stop accepting, reject held requests, drain in-flight ones for ``shutdown_grace``, send a last
        heartbeat, close. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        await self.holds.close()
        self._close_socket()
        if self._opening is not None:
            with contextlib.suppress(Exception):
                await self._opening  # being opened at the first connection: opened, to be stopped below
        if self.http is not None:
            await self.http.stop_accepting()
        # Cancelled again until done: nats-py swallows a cancellation that lands inside its connect, which
        # left a proxy stopped right after start waiting for its background task forever.
        await cancel_and_wait(*self._tasks)
        await self._stop_following()
        if self.conn is not None:
            await self._publish_heartbeat()
            await self.conn.close()
        if self.http is not None:
            await self.http.close()

    async def _serve_http(self, sock: socket.socket | None) -> None:
        from services.proxy.http_serving import HTTPServing

        self.http = HTTPServing(self)
        self._listening = await self.http.start(sock)

    def _first_connection(self) -> None:
        """The listening socket is readable: a connection waits. Serve it (and every later one) over HTTP."""
        sock = self._socket
        if sock is None:
            return
        asyncio.get_running_loop().remove_reader(sock)
        self._socket = None
        self._opening = asyncio.create_task(self._open_http(sock))

    async def _open_http(self, sock: socket.socket) -> None:
        try:
            await self._serve_http(sock)
        except Exception:
            log.exception("proxy %s: the HTTP server did not start", self.proxy_id)
            sock.close()
            raise

    def _close_socket(self) -> None:
        if self._socket is not None:
            asyncio.get_running_loop().remove_reader(self._socket)
            self._socket.close()
            self._socket = None

    async def _follow_routes(self) -> None:
        updates = self.routes.updates()
        try:
            async for snapshot in updates:
                self._check_control_version(snapshot.control_version)
                if snapshot.version != self.table.version or not same_cluster(snapshot.cluster, self.table.cluster):
                    self.table = RouteTable(snapshot)
                    self.holds.wake_all()
                    for listener in self.snapshot_listeners:
                        listener(snapshot)
        finally:
            updates.close()

    def _check_control_version(self, control_version: str) -> None:
        """Say once per control-plane version when it is outside this proxy's skew window (it serves the
        routes either way: it writes nothing but its heartbeat)."""
        if control_version == self._control_version:
            return
        self._control_version = control_version
        skew = judge_peer(Component.PROXY, VERSION, control_version)
        if skew.message:
            log.log(logging.WARNING if skew.verdict is Verdict.BEHIND else logging.ERROR, "%s", skew.message)

    async def _connect_and_report(self) -> None:
        """Connect, follow routes and heartbeat; when the connection is closed for good (nats-py never
        reconnects a connection the server dropped over a protocol error) connect anew, serving the last
        routes meanwhile."""
        while not self._stop.is_set():
            conn = await connect_with_retry(self.nats_url, f"zattera-proxy-{self.proxy_id}", self._stop)
            if conn is None:
                return
            self.conn = conn
            await self.routes.start(conn)
            await self.challenges.start(conn)
            if self.certificates is not None:
                await self.certificates.start(conn)
            # "Connected" means the snapshot subscription is live at the server. nats-py's flush() writes its
            # PING ahead of still-buffered commands, so only a second round trip is ordered after the SUB.
            with contextlib.suppress(NatsError, TimeoutError):  # a lost connection resubscribes on reconnect
                await conn.nc.flush()
                await conn.nc.flush()
            self._connected.set()
            while not conn.lost.is_set():
                await self._publish_heartbeat()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(conn.lost.wait(), self.cfg.heartbeat_interval)
            log.error("proxy %s: NATS connection closed for good; connecting anew", self.proxy_id)
            self._connected.clear()
            await self._stop_following()
            self.conn = None

    async def _stop_following(self) -> None:
        await self.routes.stop()
        await self.challenges.stop()
        if self.certificates is not None:
            await self.certificates.stop()

    async def _publish_heartbeat(self) -> None:
        heartbeat = self.stats.heartbeat(self.proxy_id, self.cfg.node_id, self.holds.held, self.table.env_ids)
        # What it routes by now, of which cluster (zattera deploy waits on it), and where clients reach it.
        heartbeat.routes_version, cluster = self.served()
        heartbeat.routes_cluster.CopyFrom(cluster)
        heartbeat.http_port, heartbeat.https_port = self.public_ports()
        # After routes_version is read: whatever is counted now was sent under those routes or earlier ones.
        old = self.balancer.old_inflight(self.table.endpoint_addrs)
        complete = True
        for drain_source in self.drain_sources:
            counts, source_complete = await drain_source()
            complete = complete and source_complete
            for env_id, count in counts.items():
                old[env_id] = old.get(env_id, 0) + count
        for env_id, count in old.items():
            heartbeat.old_inflight[env_id] = count
        heartbeat.drain_counts = complete
        if self.sample_sources:
            merged = merge_samples(heartbeat.envs, *[await source() for source in self.sample_sources])
            heartbeat.ClearField("envs")
            for env_id, sample in merged.items():
                heartbeat.envs[env_id].CopyFrom(sample)
            heartbeat.connections = sum(sample.inflight for sample in merged.values())
        for traffic_source in self.traffic_sources:  # after the samples: HAProxy's were refreshed with them
            heartbeat.release_traffic.extend(traffic_source())
        if self.conn is None or not self.conn.nc.is_connected:
            return  # the control plane is unreachable: nothing to report to (the RPS window restarts)
        try:
            await asyncio.wait_for(publish_proxy_heartbeat(self.conn, heartbeat), self.cfg.heartbeat_interval)
        except Exception as exc:
            log.debug("proxy heartbeat not published: %s", exc)

    async def _activate(self, env_id: str) -> None:
        if self.conn is None:
            raise ConnectionError("not connected to NATS yet")
        try:
            response = await request_activation(self.conn, env_id, self.cfg.node_id, timeout=self.cfg.activate_timeout)
        except ActivateError as exc:
            if exc.code in (INVALID_ARGUMENT, NOT_FOUND):
                log.warning("activation of env %s refused: %s", env_id, exc.message)
                return
            raise
        if not response.accepted:
            log.info("activation of env %s not accepted (not a scale-to-zero env)", env_id)
