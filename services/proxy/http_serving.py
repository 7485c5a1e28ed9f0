"""The proxy's HTTP side (aiohttp): the server, the upstream client session and the request pipeline composed
from ``services/proxy/pipeline/`` (one middleware per module, in its ``ORDER``). :class:`Proxy` (``server.py``)
loads this module when it serves HTTP: at start on its own (the Python data plane), at the first connection
behind HAProxy (PERFORMANCE.md "A lighter node")."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import hdrs, web

from services.proxy.pipeline.acme_challenge import AcmeChallenge
from services.proxy.pipeline.allowlist import Allowlist
from services.proxy.pipeline.basic_auth import BasicAuthCheck
from services.proxy.pipeline.body_cap import body_cap
from services.proxy.pipeline.endpoint_choice import EndpointChoice
from services.proxy.pipeline.flow import ENV_KEY, chain
from services.proxy.pipeline.forward import Forward
from services.proxy.pipeline.https_redirect import https_redirect
from services.proxy.pipeline.rate_limit import RateLimit
from services.proxy.pipeline.route_match import RouteMatch
from services.proxy.routing import RouteTable

if TYPE_CHECKING:
    from services.proxy.server import Proxy


class HTTPServing:
    """What serves :class:`Proxy`'s requests over HTTP."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        cfg = proxy.cfg
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=cfg.upstream_keepalive),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.upstream_connect_timeout),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE),
        )
        self.runner: web.ServerRunner | None = None

        def table() -> RouteTable:  # replaced on every accepted snapshot
            return proxy.table

        self.pipeline = chain(
            [
                AcmeChallenge(proxy.challenges),
                RouteMatch(table),
                Allowlist(proxy.behind_engine),
                https_redirect,
                RateLimit(proxy.limiter, proxy.behind_engine),
                BasicAuthCheck(proxy.basic_auth),
                body_cap,
                EndpointChoice(table, proxy.balancer, proxy.holds),
            ],
            Forward(
                lambda: self.session, table, proxy.balancer, proxy.holds, proxy.stats, behind_engine=proxy.behind_engine
            ),
        )
        """The request pipeline, one middleware per module of ``services/proxy/pipeline/`` in its ``ORDER``."""

    async def start(self, sock: socket.socket | None) -> int:
        """Serve on ``sock`` (listening already), else on the proxy's ``host:port``; the port served."""
        handler = self._measured if self.proxy.metrics else self.pipeline
        server = web.Server(handler, handler_cancellation=True, access_log=None)
        self.runner = web.ServerRunner(server, shutdown_timeout=self.proxy.cfg.shutdown_grace)
        await self.runner.setup()
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(self.runner, sock)
        else:
            site = web.TCPSite(self.runner, self.proxy.cfg.host, self.proxy.cfg.port)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop_accepting(self) -> None:
        """Stop accepting; in-flight requests drain for ``shutdown_grace``."""
        if self.runner is not None:
            await self.runner.cleanup()

    async def close(self) -> None:
        await self.session.close()

    async def _measured(self, request: web.BaseRequest) -> web.StreamResponse:
        """The pipeline, recording the request in ``zattera.proxy.request.duration`` (env id, status class)."""
        started = time.perf_counter()
        status = 500
        try:
            response = await self.pipeline(request)
            status = response.status
            return response
        finally:
            self.proxy.requests.observe(request.get(ENV_KEY, ""), status, time.perf_counter() - started)
