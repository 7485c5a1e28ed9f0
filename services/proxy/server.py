"""The proxy process's core: HTTP server, request pipeline, upstream forwarding, heartbeats.

Request pipeline (reference routes-snapshots.md A2.6, in its order): route match (404) → IP allowlist
(403) → HTTPS redirect (308, when the route asks for it) → per-client rate limit (429) → basic auth
(401, bcrypt: :mod:`services.proxy.auth`) → body cap (413) → endpoint choice (sticky, then P2C under the
cap) → hold-and-activate when cold or full (503/504), else 502 → forward with in-flight accounting (502
on upstream error). Every error body is ``{"error": "<msg>"}`` as JSON.

Deviations from the reference, all deliberate:

* no TLS listener here: a route without middleware is not redirected (the reference's dev mode), one with
  ``redirect_https`` is, unless ``X-Forwarded-Proto: https`` says a TLS terminator in front already did
  TLS; no gzip middleware;
* a declared body above ``middleware.max_body_bytes`` is refused up front with 413 (the reference
  cut the body mid-stream and answered 502); an undeclared (chunked) one is still cut at the cap;
* an upstream that refuses the connection (nothing was sent: its process or node just died, and the
  route snapshot does not say so yet) is retried on another healthy endpoint of the route, each at most
  once; only when none is left does the client get the 502. Without it, a dead endpoint that P2C's
  same-node tie-break keeps picking failed every request until the node was marked DOWN. A
  ``scale_to_zero`` route whose every endpoint refused is cold in fact (its replica was just cooled and
  the snapshot saying so is on its way): the request is held and the env activated, as for a cold route,
  until an endpoint that has not refused it appears (or a newer snapshot lists one again).

The route table follows the route client: built from the cached snapshot before any network activity
(so a restarted proxy serves the last routes with the control plane down), rebuilt on every accepted
snapshot, and each rebuild wakes held requests. NATS is connected in the background, with retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from nats.errors import Error as NatsError
from yarl import URL
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.activator import HoldRejected, Holds
from services.proxy.auth import BasicAuth, https_location, is_https, route_users
from services.proxy.balancer import STICKY_COOKIE, Balancer, sticky_endpoint, sticky_value
from services.proxy.haproxy_stats import merge_samples
from services.proxy.ratelimit import RateLimiter
from services.proxy.routing import RouteEntry, RouteTable, request_host
from services.proxy.settings import ROUTES_CACHE_FILE, ProxySettings
from services.proxy.stats import ProxyStats
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH
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

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
RATE_LIMIT_RETRY_AFTER = "1"
ENV_KEY = web.RequestKey("zattera.env", str)
"""Where :meth:`Proxy._handle` leaves the matched env id on the request, for the metrics."""


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    """Header names the ``Connection`` header marks as hop-by-hop."""
    return {token.strip().lower() for value in headers.getall(hdrs.CONNECTION, ()) for token in value.split(",")}


def end_to_end(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """``headers`` without hop-by-hop ones (fixed list plus those named by ``Connection``)."""
    dropped = HOP_BY_HOP | _connection_tokens(headers) if hdrs.CONNECTION in headers else HOP_BY_HOP
    return CIMultiDict((name, value) for name, value in headers.items() if name.lower() not in dropped)


def upstream_request_headers(
    request: web.BaseRequest, client_ip: str | None, *, drop_authorization: bool = False
) -> CIMultiDict[str]:
    """End-to-end headers (Host preserved) plus ``X-Forwarded-For`` (appended), ``-Proto`` and ``-Host``.
    ``client_ip`` None: an engine in front already set the forwarded headers (kept as they are).
    ``drop_authorization``: the proxy checked the credentials itself (the route's basic auth), so the app
    never sees the password."""
    headers = end_to_end(request.headers)
    if drop_authorization:
        headers.popall(hdrs.AUTHORIZATION, None)
    if client_ip is None:
        return headers
    prior = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    headers["X-Forwarded-Proto"] = request.scheme
    headers["X-Forwarded-Host"] = request.headers.get(hdrs.HOST, "")
    return headers


async def capped(body: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The request body, failing once it exceeds ``limit`` bytes (the upstream request then fails: 502)."""
    seen = 0
    async for chunk in body.iter_any():
        seen += len(chunk)
        if seen > limit:
            raise ValueError(f"request body exceeds {limit} bytes")
        yield chunk


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes; ``entry`` None = its route is gone (404)."""

    entry: RouteEntry | None
    endpoint: cpb.Endpoint | None = None


class Proxy:
    def __init__(
        self,
        cfg: ProxySettings,
        *,
        nats_url: str,
        cache_dir: Path,
        metrics: bool = False,
        behind_engine: bool = False,
    ) -> None:
        self.cfg = cfg
        self.behind_engine = behind_engine
        """Serving for an engine in front (HAProxy): the client is the last ``X-Forwarded-For`` value."""
        self.snapshot_listeners: list[Callable[[cpb.RouteSnapshot], None]] = []
        self.sample_sources: list[Callable[[], Awaitable[dict[str, cpb.ProxySample]]]] = []
        """Other data paths' per-env samples, merged into this proxy's heartbeat."""
        self.served: Callable[[], tuple[int, cpb.ClusterIdentity]] = lambda: (self.table.version, self.table.cluster)
        """The routes version the data plane serves, and their cluster (an engine in front may lag the Python
        table)."""
        self.public_ports: Callable[[], tuple[int, int]] = lambda: (self._listening, 0)
        """Where clients reach this proxy: (HTTP port, HTTPS port; 0 = none), reported in the heartbeat so that
        the URLs the CLI and console show carry the port that works (an engine in front reports its own)."""
        self.metrics = metrics
        self._requests = RequestSeries()
        self.nats_url = nats_url
        self.proxy_id = cfg.proxy_id or socket.gethostname()
        self.routes = RouteClient(cache_dir / ROUTES_CACHE_FILE, node_id=cfg.node_id)
        self.table = RouteTable(self.routes.current)
        self._control_version: str | None = None
        self.balancer = Balancer(cfg.node_id)
        self.limiter = RateLimiter()
        self.basic_auth = BasicAuth()
        self.stats = ProxyStats()
        self.holds = Holds(
            self._activate,
            max_held_per_env=cfg.max_held_per_env,
            hold_timeout=cfg.hold_timeout,
            max_body_bytes=cfg.max_held_body_bytes,
        )
        self.challenges = ChallengeAnswers()
        self.certificates: CertClient | None = None
        """Set by a TLS engine in front: followed on every connection, like the routes."""
        self.conn: Connection | None = None
        self._connected = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._listening = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        assert self._runner is not None, "start() first"
        return int(self._runner.addresses[0][1])

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def start(self) -> None:
        """Serve at once from the cached routes; connect to NATS in the background."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.cfg.upstream_keepalive),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.upstream_connect_timeout),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE),
        )
        handler = self._measured if self.metrics else self._handle
        server = web.Server(handler, handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(server, shutdown_timeout=self.cfg.shutdown_grace)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.host, self.cfg.port).start()
        self._listening = self.port
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
        if self._runner is not None:
            await self._runner.cleanup()
        # Cancelled again until done: nats-py swallows a cancellation that lands inside its connect, which
        # left a proxy stopped right after start waiting for its background task forever.
        await cancel_and_wait(*self._tasks)
        await self._stop_following()
        if self.conn is not None:
            await self._publish_heartbeat()
            await self.conn.close()
        if self._session is not None:
            await self._session.close()

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
        if self.sample_sources:
            merged = merge_samples(heartbeat.envs, *[await source() for source in self.sample_sources])
            heartbeat.ClearField("envs")
            for env_id, sample in merged.items():
                heartbeat.envs[env_id].CopyFrom(sample)
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

    # ------------------------------------------------------------------ requests

    def _client_ip(self, request: web.BaseRequest) -> str:
        if self.behind_engine:
            forwarded = request.headers.getall("X-Forwarded-For", ())
            if forwarded:
                return forwarded[-1].rsplit(",", 1)[-1].strip()
        return request.remote or ""

    def _choose(self, host: str, path: str) -> Choice | None:
        """Re-match and re-pick for a held request: None = keep waiting."""
        entry = self.table.match(host, path)
        if entry is None:
            return Choice(None)
        endpoint = self.balancer.pick(entry.route.endpoints, entry.route.max_concurrency)
        return Choice(entry, endpoint) if endpoint is not None else None

    async def _measured(self, request: web.BaseRequest) -> web.StreamResponse:
        """:meth:`_handle`, recording the request in ``zattera.proxy.request.duration`` (env id, status class)."""
        started = time.perf_counter()
        status = 500
        try:
            response = await self._handle(request)
            status = response.status
            return response
        finally:
            self._requests.observe(request.get(ENV_KEY, ""), status, time.perf_counter() - started)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        host = request_host(request.headers.get(hdrs.HOST, ""))
        path = request.path
        if path.startswith(CHALLENGE_PATH) and (answer := await self.challenges.lookup(path)) is not None:
            return web.Response(text=answer, content_type="application/octet-stream")  # ACME HTTP-01
        entry = self.table.match(host, path)
        if entry is None:
            return error_response(404, "no route for host")
        route = entry.route
        request[ENV_KEY] = route.environment_id
        client_ip = self._client_ip(request)
        if not entry.admits(client_ip):
            return error_response(403, "forbidden")
        middleware = route.middleware if route.HasField("middleware") else None
        if (
            middleware is not None
            and middleware.redirect_https
            and not path.startswith(CHALLENGE_PATH)  # an app answering its own challenges: CAs ask over HTTP
            and not is_https(request.scheme, request.headers.get("X-Forwarded-Proto", ""))
        ):
            location = https_location(request.headers.get(hdrs.HOST, host), request.path_qs)
            return web.Response(status=308, headers={hdrs.LOCATION: location})
        if route.HasField("rate_limit") and route.rate_limit.requests_per_second > 0:
            rps = route.rate_limit.requests_per_second
            if not self.limiter.allow(f"{route.environment_id}|{client_ip}", rps, route.rate_limit.burst or rps):
                return error_response(429, "rate limit exceeded", {"Retry-After": RATE_LIMIT_RETRY_AFTER})
        users = route_users(middleware) if middleware is not None else {}
        if users and not await self.basic_auth.admits(users, request.headers.get(hdrs.AUTHORIZATION, "")):
            return error_response(401, "unauthorized", {"WWW-Authenticate": 'Basic realm="zattera"'})
        body_cap = middleware.max_body_bytes if middleware is not None else 0
        if body_cap and request.content_length is not None and request.content_length > body_cap:
            return error_response(413, "request body too large")

        endpoint: cpb.Endpoint | None = None
        pin_cookie = False
        if middleware is not None and middleware.sticky_sessions:
            cookie = request.cookies.get(STICKY_COOKIE)
            endpoint = sticky_endpoint(route.endpoints, cookie) if cookie else None
            pin_cookie = endpoint is None
        if endpoint is None:
            endpoint = self.balancer.pick(route.endpoints, route.max_concurrency)
        if endpoint is None:
            healthy = any(e.healthy for e in route.endpoints)
            cold = route.scale_to_zero and not healthy
            full = route.max_concurrency > 0 and healthy
            if not (cold or full):
                return error_response(502, "no healthy endpoint")
            try:
                choice = await self.holds.hold(
                    route.environment_id, request.content_length, lambda: self._choose(host, path)
                )
            except HoldRejected as exc:
                headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
                return error_response(exc.status, exc.message, headers)
            if choice.entry is None or choice.endpoint is None:
                return error_response(404, "no route for host")
            route, endpoint = choice.entry.route, choice.endpoint
        return await self._forward(request, route, endpoint, body_cap, pin_cookie, host=host, path=path)

    def _choose_unrefused(self, host: str, path: str, refused: dict[str, int]) -> Choice | None:
        """:meth:`_choose` among the endpoints that have not refused this request, or that a snapshot newer
        than the one they refused it under lists again."""
        entry = self.table.match(host, path)
        if entry is None:
            return Choice(None)
        version = self.table.version
        endpoints = [e for e in entry.route.endpoints if version > refused.get(e.addr, -1)]
        endpoint = self.balancer.pick(endpoints, entry.route.max_concurrency)
        return Choice(entry, endpoint) if endpoint is not None else None

    async def _forward(
        self,
        request: web.BaseRequest,
        route: cpb.HTTPRoute,
        endpoint: cpb.Endpoint,
        body_cap: int,
        pin_cookie: bool,
        *,
        host: str,
        path: str,
    ) -> web.StreamResponse:
        env_id, addr = route.environment_id, endpoint.addr
        checked = route.HasField("middleware") and bool(route_users(route.middleware))
        assert self._session is not None
        self.balancer.acquire(addr)
        self.stats.begin(env_id)
        started = time.perf_counter()
        status = 502
        try:
            target = request.raw_path if request.raw_path.startswith("/") else request.rel_url.raw_path_qs
            tried = {addr}
            refused: dict[str, int] = {}
            """Address → the route table version under which it refused this request."""
            hold_until: float | None = None
            while True:
                body: object = None
                if request.body_exists:
                    body = capped(request.content, body_cap) if body_cap else request.content
                try:
                    upstream = await self._session.request(
                        request.method,
                        URL(f"http://{addr}{target}", encoded=True),
                        headers=upstream_request_headers(
                            request, None if self.behind_engine else request.remote or "", drop_authorization=checked
                        ),
                        data=body,
                        allow_redirects=False,
                    )
                    break
                except aiohttp.ClientConnectorError as exc:
                    # Not connected, so nothing (body included) was sent: another endpoint may take it.
                    refused[addr] = self.table.version
                    retry = self.balancer.pick(
                        [e for e in route.endpoints if e.addr not in tried], route.max_concurrency
                    )
                    if retry is None and route.scale_to_zero:
                        log.debug("upstream %s refused, no other endpoint: holding (cold in fact): %r", addr, exc)
                        self.balancer.release(addr)
                        loop = asyncio.get_running_loop()
                        hold_until = hold_until or loop.time() + self.holds.hold_timeout
                        try:
                            choice = await self.holds.hold(
                                env_id,
                                request.content_length,
                                lambda: self._choose_unrefused(host, path, refused),
                                timeout=hold_until - loop.time(),
                            )
                        except HoldRejected as rejected:
                            self.balancer.acquire(addr)  # released again on the way out
                            headers = {"Retry-After": rejected.retry_after} if rejected.retry_after else None
                            return error_response(rejected.status, rejected.message, headers)
                        if choice.entry is None or choice.endpoint is None:
                            self.balancer.acquire(addr)
                            return error_response(404, "no route for host")
                        route, retry = choice.entry.route, choice.endpoint
                        endpoint, addr = retry, retry.addr
                        self.balancer.acquire(addr)
                        tried.add(addr)
                        continue
                    if retry is None:
                        log.debug("upstream %s refused, no other endpoint: %r", addr, exc)
                        return error_response(502, "upstream error")
                    log.debug("upstream %s refused (%r); retrying on %s", addr, exc, retry.addr)
                    self.balancer.release(addr)
                    endpoint, addr = retry, retry.addr
                    self.balancer.acquire(addr)
                    tried.add(addr)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    log.debug("upstream %s failed: %r", addr, exc)
                    return error_response(502, "upstream error")
            async with upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                response.headers.extend(end_to_end(upstream.headers))
                if pin_cookie:
                    response.set_cookie(
                        STICKY_COOKIE,
                        sticky_value(endpoint),
                        path="/",
                        httponly=True,
                        samesite="Lax",
                        secure=request.secure,
                    )
                await response.prepare(request)
                status = upstream.status
                while True:
                    try:
                        chunk = await upstream.content.readany()
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        log.debug("upstream %s broke mid-response: %r", addr, exc)
                        status = 502
                        if request.transport is not None:
                            request.transport.abort()  # the client must see a truncated response, not a short one
                        return response
                    if not chunk:
                        break
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            self.balancer.release(addr)
            self.stats.end(env_id, status, time.perf_counter() - started)
            self.holds.wake_env(env_id)
