"""Forward: the last step of the pipeline. Sends the request to the chosen endpoint with in-flight
accounting and streams the answer back (502 on an upstream error). An upstream that refuses the connection
(nothing was sent: its process or node just died, and the route snapshot does not say so yet) is retried on
another healthy endpoint of the route, each at most once; a ``scale_to_zero`` route whose every endpoint
refused is cold in fact: the request is held and the env activated, as for a cold route, until an endpoint
that has not refused it appears. A GET or HEAD (no body) whose upstream closed the connection without
answering (its replica died under it) is treated the same way; any other request gets the 502."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from services.proxy.activator import HoldRejected, Holds
from services.proxy.balancer import STICKY_COOKIE, Balancer, sticky_value
from services.proxy.pipeline.body_cap import capped
from services.proxy.pipeline.endpoint_choice import choose
from services.proxy.pipeline.flow import Flow, error_response
from services.proxy.routing import RouteTable
from services.proxy.stats import ProxyStats

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
REPLAYABLE = frozenset({"GET", "HEAD"})
"""Requests sent again when their upstream closed the connection without answering (idempotent, no body)."""


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


@dataclass(eq=False)
class Forward:
    session: Callable[[], aiohttp.ClientSession | None]
    table: Callable[[], RouteTable]
    balancer: Balancer
    holds: Holds
    stats: ProxyStats
    _: KW_ONLY
    behind_engine: bool

    async def __call__(self, flow: Flow) -> web.StreamResponse:
        request, entry, endpoint = flow.request, flow.entry, flow.endpoint
        assert entry is not None and endpoint is not None, "after the endpoint choice"
        host, path, body_cap = flow.host, flow.path, flow.body_cap
        route, env_id, addr = entry.route, entry.env_id, endpoint.addr
        checked = bool(entry.users)
        session = self.session()
        assert session is not None
        self.balancer.acquire(addr, env_id)
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
                    upstream = await session.request(
                        request.method,
                        URL(f"http://{addr}{target}", encoded=True),
                        headers=upstream_request_headers(
                            request, None if self.behind_engine else request.remote or "", drop_authorization=checked
                        ),
                        data=body,
                        allow_redirects=False,
                    )
                    break
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                    # Not connected, so nothing (body included) was sent: another endpoint may take it. Closed
                    # without an answer (its replica died under it: cooled, scaled down): only a GET or HEAD
                    # without a body may be sent again.
                    if isinstance(exc, aiohttp.ServerDisconnectedError) and (
                        request.method not in REPLAYABLE or request.body_exists
                    ):
                        log.debug("upstream %s closed without an answer: %r", addr, exc)
                        return error_response(502, "upstream error")
                    refused[addr] = self.table().version
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
                                lambda: choose(self.table(), self.balancer, host, path, refused),
                                timeout=hold_until - loop.time(),
                            )
                        except HoldRejected as rejected:
                            self.balancer.acquire(addr, env_id)  # released again on the way out
                            headers = {"Retry-After": rejected.retry_after} if rejected.retry_after else None
                            return error_response(rejected.status, rejected.message, headers)
                        if choice.entry is None or choice.endpoint is None:
                            self.balancer.acquire(addr, env_id)
                            return error_response(404, "no route for host")
                        route, retry = choice.entry.route, choice.endpoint
                        endpoint, addr = retry, retry.addr
                        self.balancer.acquire(addr, env_id)
                        tried.add(addr)
                        continue
                    if retry is None:
                        log.debug("upstream %s refused, no other endpoint: %r", addr, exc)
                        return error_response(502, "upstream error")
                    log.debug("upstream %s refused (%r); retrying on %s", addr, exc, retry.addr)
                    self.balancer.release(addr)
                    endpoint, addr = retry, retry.addr
                    self.balancer.acquire(addr, env_id)
                    tried.add(addr)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    log.debug("upstream %s failed: %r", addr, exc)
                    return error_response(502, "upstream error")
            async with upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                response.headers.extend(end_to_end(upstream.headers))
                if flow.pin_cookie:
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
            self.stats.end(env_id, status, time.perf_counter() - started, endpoint)
            self.holds.wake_env(env_id)
