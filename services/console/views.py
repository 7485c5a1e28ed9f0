"""The console's pages and their JSON twins: overview, env, nodes, builds, volumes, events, audit (what they
show is ``pages.py``'s)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from aiohttp import web

from services.console.handling import Console, console_of, is_api, refuse, render
from services.console.metrics_views import env_charts_context, env_or_404, window_problem
from services.console.overview import render_overview
from shared.audit import DEFAULT_LIMIT, parse_since, read_entries, select
from shared.backup.status import backup_status
from shared.notify_status import failing_channels

from . import pages


async def overview_page(request: web.Request) -> web.StreamResponse:
    only = [env_id for env_id in request.query.get("only", "").split(",") if env_id]
    return await render_overview(request, only)


async def overview_api(request: web.Request) -> web.Response:
    console = console_of(request)
    overview = pages.overview(console.view, console.routes(), listeners=console.listeners())
    backups = backup_status(console.view)
    return web.json_response(
        {
            "environments": overview,
            "backups": {**dataclasses.asdict(backups), "failing": backups.failing},
            "notifications": {"failing": failing_channels(console.view)},
        }
    )


def _env_detail(console: Console, env_id: str) -> dict[str, Any]:
    env = env_or_404(console, env_id)
    routes = console.routes()
    urls = pages.urls_by_env(console.view, routes, console.listeners()).get(env_id, [])
    certificates = pages.certificates_by_env(console.view, routes).get(env_id, [])
    detail = pages.env_detail(console.view, env, urls, certificates)
    heartbeats = console.live.fresh_proxy_heartbeats() if console.live is not None else []
    detail["canary"] = pages.env_canary(console.view, env_id, heartbeats)
    return detail


async def env_page(request: web.Request) -> web.Response:
    console = console_of(request)
    env_id = request.match_info["env_id"]
    detail = _env_detail(console, env_id)
    if (problem := window_problem(request)) is not None:
        return refuse(request, 400, problem)
    charts = await env_charts_context(console, env_id, request.query.get("window", ""))
    return render(request, "env.html", page="env", env=detail, **charts)


async def env_api(request: web.Request) -> web.Response:
    return web.json_response(_env_detail(console_of(request), request.match_info["env_id"]))


async def nodes_page(request: web.Request) -> web.Response:
    return render(request, "nodes.html", page="nodes", nodes=pages.nodes(console_of(request).view))


async def builds_page(request: web.Request) -> web.Response:
    return render(request, "builds.html", page="builds", builds=pages.builds(console_of(request).view))


async def build_page(request: web.Request) -> web.Response:
    build_id = request.match_info["build_id"]
    build = console_of(request).view.build(build_id)
    if build is None:
        raise web.HTTPNotFound(text=f"build {build_id!r} not found")
    return render(request, "build.html", page="build", build_id=build_id)


async def volumes_page(request: web.Request) -> web.Response:
    return render(request, "volumes.html", page="volumes", volumes=pages.volumes(console_of(request).view))


async def events_page(request: web.Request) -> web.Response:
    return render(request, "events.html", page="events")


AUDIT_SCAN = 10_000
"""Without ``since``, the audit page looks through this many of the newest entries."""


async def audit_page(request: web.Request) -> web.Response:
    """The audit log (docs/audit.md), newest first: ``?since=1h&user=U&limit=N``; JSON at ``/api/audit``."""
    console = console_of(request)
    since, user = request.query.get("since", "").strip(), request.query.get("user", "").strip()
    try:
        since_ns = int((time.time() - parse_since(since)) * 1e9) if since else 0
    except ValueError as exc:
        return refuse(request, 400, f"since {since!r}: {exc}")
    try:
        limit = int(request.query.get("limit", "") or DEFAULT_LIMIT)
        if limit < 0:
            raise ValueError
    except ValueError:
        return refuse(request, 400, f"limit {request.query.get('limit', '')!r}: a whole number, 0 or more")
    entries = select(await read_entries(console.conn, since_ns=since_ns, scan=AUDIT_SCAN), user=user, limit=limit)
    if is_api(request):
        return web.json_response({"entries": [e.to_dict() for e in entries]})
    return render(request, "audit.html", page="audit", entries=entries, since=since, user=user, limit=limit)
