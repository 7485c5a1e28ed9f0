"""What every console handler shares: the :class:`Console` (connection, view, sessions, templates), the
request's console and session, and rendering a page or a refusal."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.actions.context import ActionContext
from shared.audit import AuditLog
from shared.connection import Connection
from shared.state.feed import StateView
from shared.urls import Listeners

from . import pages
from .auth import LoginLimiter, Session, Sessions
from .display import FILTERS as DISPLAY_FILTERS

log = logging.getLogger(__name__)


HERE = Path(__file__).parent


LIVE_HEADER = "X-Console-Live"


STREAM_CHUNK = 16 * 1024


STATE: web.AppKey[Console] = web.AppKey("console")


SESSION = web.RequestKey("session", Session)


@dataclass
class Console:
    conn: Connection
    view: StateView
    actions: ActionContext
    """Acting as nobody: each request acts as its session's user (``forms.py``)."""
    sessions: Sessions
    limiter: LoginLimiter
    routes: Callable[[], cpb.RouteSnapshot | None]
    secure_cookies: bool = False
    listeners: Callable[[], Listeners] = Listeners
    """Where the proxies listen (their heartbeats): the URLs shown carry those ports."""
    audit: AuditLog | None = None
    """Where the users' writes are recorded (docs/audit.md); None: nowhere (tests of pages only)."""
    git: Any = None
    """The ``git push`` endpoint (:class:`services.console.git.GitService`); None: not served."""
    live: Any = None
    """The :class:`shared.live.LiveView` (a node page's current figures); None: not followed."""

    def __post_init__(self) -> None:
        self.flash: dict[str, str] = {}
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.filters.update(DISPLAY_FILTERS)  # short ids and image refs (issue 40)


def console_of(request: web.Request) -> Console:
    return request.app[STATE]


def session_of(request: web.Request) -> Session:
    return request[SESSION]


def is_api(request: web.Request) -> bool:
    return request.path.startswith("/api/") or "application/json" in request.headers.get("Accept", "")


def is_secure(request: web.Request, console: Console) -> bool:
    return console.secure_cookies or request.secure


def redirect_to(where: str) -> web.Response:
    """303 See Other: after a form's POST the browser GETs ``where``."""
    return web.Response(status=303, headers={"Location": where})


def client_address(request: web.Request) -> str:
    return request.remote or "?"


def _page(request: web.Request, template: str, context: dict[str, Any]) -> tuple[jinja2.Template, dict[str, Any]]:
    console = console_of(request)
    session = request.get(SESSION)
    # A live refresh (the page fetching itself) must not take the notice meant for the next page shown.
    live_refresh = LIVE_HEADER in request.headers
    notice = console.flash.pop(session.csrf, "") if session is not None and not live_refresh else ""
    revision = pages.page_revision(console.view, context.get("page", ""))
    full = {"session": session, "notice": notice, "path": request.path, "revision": revision, **context}
    return console.templates.get_template(template), full


def render(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    page, full = _page(request, template, context)
    return web.Response(text=page.render(full), status=status, content_type="text/html")


async def render_streamed(request: web.Request, template: str, **context: Any) -> web.StreamResponse:
    """A long page sent as it is rendered: the browser paints the top while the rest is still coming."""
    page, full = _page(request, template, context)
    response = web.StreamResponse(headers={"Content-Type": "text/html; charset=utf-8"})
    await response.prepare(request)
    pending: list[str] = []
    size = 0
    for piece in page.generate(full):
        pending.append(piece)
        size += len(piece)
        if size >= STREAM_CHUNK:
            await response.write("".join(pending).encode())
            pending, size = [], 0
    await response.write("".join(pending).encode())
    await response.write_eof()
    return response


def refuse(request: web.Request, status: int, message: str) -> web.Response:
    if is_api(request):
        return web.json_response({"error": message}, status=status)
    return render(request, "error.html", status=status, message=message)
