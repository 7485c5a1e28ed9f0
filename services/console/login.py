"""The console's sessions on the HTTP side: the middleware that requires one (and the CSRF token on a POST),
the security headers of every answer, and the login and logout handlers (``auth.py`` keeps the sessions)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.console.handling import (
    SESSION,
    client_address,
    console_of,
    is_api,
    is_secure,
    redirect_to,
    refuse,
    render,
)
from shared.console_users import ADMIN, burn_check, load_user, password_matches

from .auth import LOGIN_COOKIE, SESSION_COOKIE, tokens_equal

log = logging.getLogger(__name__)

PUBLIC = ("/login", "/static/", "/hooks/", "/git/")  # /hooks/: signed deliveries; /git/: HTTP basic auth (git.py)


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """On every response, streamed ones included (set as it is prepared)."""
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    if not request.path.startswith("/static/"):
        response.headers["Cache-Control"] = "no-store"


@web.middleware
async def require_session(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.path.startswith(PUBLIC):
        return await handler(request)
    if request.headers.get("Authorization", "").startswith("Bearer "):
        # An API token (docs/teams.md): no cookie, so no CSRF to check; scoped to its project.
        from services.console.teams import bearer_request

        return await bearer_request(request, handler)
    console = console_of(request)
    token = request.cookies.get(SESSION_COOKIE, "")
    session = console.sessions.get(token)
    if session is not None:
        # A removed user's sessions end, and a changed role applies, from their next request.
        user = await load_user(console.conn.js, session.user)
        if user is None:
            console.sessions.close(token)
            session = None
        elif user.role != session.role:
            session = console.sessions.set_role(token, user.role)
    if session is None:
        if is_api(request) or request.method != "GET":
            return web.json_response({"error": "not logged in"}, status=401)
        return redirect_to("/login")
    request[SESSION] = session
    if request.method == "POST":
        csrf = request.headers.get("X-CSRF-Token", "")
        if not csrf and request.content_type == "application/x-www-form-urlencoded":
            csrf = str((await request.post()).get("csrf", ""))
        if not tokens_equal(csrf, session.csrf):
            return refuse(request, 403, "refused: the form's CSRF token is missing or wrong (reload the page)")
        if session.role != ADMIN and request.path != "/logout":
            return refuse(request, 403, f"refused: user {session.user} has the {session.role} role, which cannot act")
    return await handler(request)


async def login_page(request: web.Request) -> web.Response:
    # Kept while the browser has one: a second tab (or a redirected favicon request) must not void the first form.
    token = request.cookies.get(LOGIN_COOKIE, "") or secrets.token_urlsafe(24)
    response = render(request, "login.html", login_token=token, error="")
    _set_cookie(request, response, LOGIN_COOKIE, token, path="/login")
    return response


def _set_cookie(request: web.Request, response: web.StreamResponse, name: str, value: str, *, path: str = "/") -> None:
    response.set_cookie(
        name, value, path=path, httponly=True, samesite="Strict", secure=is_secure(request, console_of(request))
    )


async def login(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    form = await request.post()
    name = str(form.get("username", "")).strip()
    password = str(form.get("password", ""))
    if not tokens_equal(str(form.get("login_token", "")), request.cookies.get(LOGIN_COOKIE, "")):
        return refuse(request, 403, "refused: the login form's token is missing or wrong (reload the page)")
    wait = console.limiter.retry_after(client_address(request), name)
    if wait > 0:
        response = render(
            request,
            "login.html",
            status=429,
            login_token=form.get("login_token", ""),
            error=f"too many failed logins: try again in {int(wait) + 1} s",
        )
        response.headers["Retry-After"] = str(int(wait) + 1)
        return response
    user = await load_user(console.conn.js, name)
    loop = asyncio.get_running_loop()
    ok = False
    if user is None:
        await loop.run_in_executor(None, burn_check, password)
    else:
        ok = await loop.run_in_executor(None, password_matches, user, password)
    if user is None or not ok:
        console.limiter.failed(client_address(request), name)
        return render(
            request,
            "login.html",
            status=401,
            login_token=form.get("login_token", ""),
            error="wrong user name or password",
        )
    console.limiter.succeeded(name)
    token, _ = console.sessions.open(user.name, user.role)
    response = redirect_to("/")
    _set_cookie(request, response, SESSION_COOKIE, token)
    response.del_cookie(LOGIN_COOKIE, path="/login")
    log.info("console: %s logged in (%s)", user.name, user.role)
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    console_of(request).sessions.close(request.cookies.get(SESSION_COOKIE, ""))
    response = redirect_to("/login")
    response.del_cookie(SESSION_COOKIE, path="/")
    return response
