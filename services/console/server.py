"""Runs the console's HTTP server for as long as the service runs."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from pathlib import Path

from aiohttp import web

from services.console.auth import LoginLimiter, Sessions
from services.console.git import ENDPOINT_KEY, GitService
from services.console.handling import Console
from services.console.settings import ConsoleSettings
from services.console.web import make_app
from shared.actions.context import ActionContext
from shared.audit import AuditLog
from shared.clock import Clock
from shared.connection import Connection
from shared.console_users import users_bucket
from shared.live import LiveView
from shared.routeclient import RouteClient
from shared.snapshots.dispatch import operator_dispatcher
from shared.state.feed import StateView
from shared.txn import Writer
from shared.urls import Listeners, proxy_listeners

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = 2.0
"""Open SSE streams end when the console stops; they are not waited for longer than this."""


def build_console(
    conn: Connection,
    view: StateView,
    writer: Writer,
    clock: Clock,
    cfg: ConsoleSettings,
    routes: RouteClient,
    live: LiveView | None = None,
) -> Console:
    return Console(
        conn=conn,
        view=view,
        actions=ActionContext(
            conn,
            writer,
            actor="",
            clock=clock,
            snapshots=operator_dispatcher(conn, view, clock),
        ),
        sessions=Sessions(clock, cfg.session_ttl),
        limiter=LoginLimiter(clock, cfg.login_failures, cfg.login_window),
        routes=lambda: routes.current if routes.version else None,
        secure_cookies=cfg.secure_cookies,
        listeners=(lambda: proxy_listeners(live.fresh_proxy_heartbeats())) if live is not None else Listeners,
        audit=AuditLog(conn),
        live=live,
    )


async def start_site(
    console: Console,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
) -> tuple[web.AppRunner, int]:
    """Serve ``console`` on host:port (0 = a free port), HTTPS with ``ssl_context``; returns the runner and the
    bound port."""
    runner = web.AppRunner(make_app(console), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=shutdown_timeout, ssl_context=ssl_context)
    await site.start()
    return runner, int(runner.addresses[0][1])


def advertised_host(host: str) -> str:
    """The host a client reaches the console at: a wildcard listen address is reached by the machine's name."""
    if host in ("", "0.0.0.0", "::"):
        return socket.getfqdn()
    return f"[{host}]" if ":" in host else host


async def record_endpoint(conn: Connection, url: str) -> None:
    """Where this console answers, for ``zattera git remote`` (the newest console to start wins)."""
    kv = await users_bucket(conn.js, create=True)
    if kv is not None:
        await kv.put(ENDPOINT_KEY, json.dumps({"url": url}).encode())


async def serve_console(
    conn: Connection, view: StateView, writer: Writer, clock: Clock, cfg: ConsoleSettings, cache_dir: Path
) -> None:
    await users_bucket(conn.js, create=True)  # `zattera console add-user` writes into it
    routes = RouteClient(cache_dir / "routes.pb")
    await routes.start(conn)
    live = LiveView(conn, clock)  # the proxies' heartbeats: where they listen, for the URLs shown
    await live.start()
    console = build_console(conn, view, writer, clock, cfg, routes, live)
    git = GitService(cache_dir / "git", conn, view, console.actions, console.limiter, clock)
    await git.start()
    console.git = git
    tls = cfg.ssl_context()
    runner, port = await start_site(console, cfg.host, cfg.port, tls)
    log.info("console: serving on %s://%s:%d", "https" if tls else "http", cfg.host, port)
    await record_endpoint(conn, f"{'https' if tls else 'http'}://{advertised_host(cfg.host)}:{port}")
    try:
        await asyncio.Event().wait()
    finally:
        await git.stop()
        await runner.cleanup()
        await console.actions.background.close()
        await routes.stop()
        await live.stop()
