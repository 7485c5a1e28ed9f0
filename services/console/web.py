"""The console's HTTP side (aiohttp): server-rendered pages, a small JSON API and SSE streams.

Every page and API call needs a session (``auth.py``); every POST needs the session's CSRF token (form field
``csrf`` or header ``X-CSRF-Token``) and the admin role. Live updates are Server-Sent Events: ``/live`` says
"something this page shows changed" (fed by the state view's change notifications) and the browser fetches
the page again and swaps its live regions; logs, build logs and events stream their lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext
from shared.actions.deploys import Rollback, rollback
from shared.actions.envs import Scale, scale
from shared.actions.jobs import CancelJob, cancel_job
from shared.actions.nodes import EditNode, NodeChange, edit_node
from shared.actions.refusals import ActionRefused, Invalid, Refusal
from shared.actions.secrets import SetSecret, set_secret
from shared.actions.volumes import RestoreVolume, TakeSnapshot, restore_volume, take_snapshot
from shared.applogs import AppLogLine, UnknownLogStream, read_app_logs
from shared.buildlogs import follow_build_log
from shared.connection import Connection
from shared.console_users import ADMIN, burn_check, load_user, password_matches
from shared.state.feed import StateView
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX
from shared.urls import Listeners

from . import pages
from .auth import LOGIN_COOKIE, SESSION_COOKIE, LoginLimiter, Session, Sessions, tokens_equal

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEARTBEAT = 15.0
"""An SSE comment this often keeps proxies from closing an idle stream."""
EVENTS_BACKLOG = 100
LOG_BACKLOG = 100
LOG_STREAM_RETRY = 1.0
LIVE_HEADER = "X-Console-Live"
STREAM_CHUNK = 16 * 1024

QUICK_ANSWER = 1.0
"""How long a restore is waited for before the answer is "started" (its refusals come sooner than this)."""
NODE_CHANGES = frozenset({NodeChange.CORDON, NodeChange.UNCORDON, NodeChange.DRAIN})
REFUSAL_STATUS = {
    Refusal.NOT_FOUND: 409,
    Refusal.INVALID: 409,
    Refusal.CONFLICT: 409,
    Refusal.FORBIDDEN: 403,
    Refusal.UNAVAILABLE: 503,
}
"""The console answers a refused action 409 with the message naming the bad field (docs/console.md); a
node or service that did not answer, 503."""

STATE: web.AppKey[Console] = web.AppKey("console")
SESSION = web.RequestKey("session", Session)


@dataclass
class Console:
    conn: Connection
    view: StateView
    actions: ActionContext
    """Acting as nobody: each request acts as its session's user (:func:`_acting`)."""
    sessions: Sessions
    limiter: LoginLimiter
    routes: Callable[[], cpb.RouteSnapshot | None]
    secure_cookies: bool = False
    listeners: Callable[[], Listeners] = Listeners
    """Where the proxies listen (their heartbeats): the URLs shown carry those ports."""

    def __post_init__(self) -> None:
        self.flash: dict[str, str] = {}
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )


def _console(request: web.Request) -> Console:
    return request.app[STATE]


def _session(request: web.Request) -> Session:
    return request[SESSION]


def _is_api(request: web.Request) -> bool:
    return request.path.startswith("/api/") or "application/json" in request.headers.get("Accept", "")


def _secure(request: web.Request, console: Console) -> bool:
    return console.secure_cookies or request.secure


def _redirect(where: str) -> web.Response:
    """303 See Other: after a form's POST the browser GETs ``where``."""
    return web.Response(status=303, headers={"Location": where})


def _address(request: web.Request) -> str:
    return request.remote or "?"


def _page(request: web.Request, template: str, context: dict[str, Any]) -> tuple[jinja2.Template, dict[str, Any]]:
    console = _console(request)
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
    if _is_api(request):
        return web.json_response({"error": message}, status=status)
    return render(request, "error.html", status=status, message=message)


PUBLIC = ("/login", "/static/")


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
    console = _console(request)
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
        if _is_api(request) or request.method != "GET":
            return web.json_response({"error": "not logged in"}, status=401)
        return _redirect("/login")
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


# ------------------------------------------------------------------------------------------------- login


async def login_page(request: web.Request) -> web.Response:
    # Kept while the browser has one: a second tab (or a redirected favicon request) must not void the first form.
    token = request.cookies.get(LOGIN_COOKIE, "") or secrets.token_urlsafe(24)
    response = render(request, "login.html", login_token=token, error="")
    _set_cookie(request, response, LOGIN_COOKIE, token, path="/login")
    return response


def _set_cookie(request: web.Request, response: web.StreamResponse, name: str, value: str, *, path: str = "/") -> None:
    response.set_cookie(
        name, value, path=path, httponly=True, samesite="Strict", secure=_secure(request, _console(request))
    )


async def login(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    form = await request.post()
    name = str(form.get("username", "")).strip()
    password = str(form.get("password", ""))
    if not tokens_equal(str(form.get("login_token", "")), request.cookies.get(LOGIN_COOKIE, "")):
        return refuse(request, 403, "refused: the login form's token is missing or wrong (reload the page)")
    wait = console.limiter.retry_after(_address(request), name)
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
        console.limiter.failed(_address(request), name)
        return render(
            request,
            "login.html",
            status=401,
            login_token=form.get("login_token", ""),
            error="wrong user name or password",
        )
    console.limiter.succeeded(name)
    token, _ = console.sessions.open(user.name, user.role)
    response = _redirect("/")
    _set_cookie(request, response, SESSION_COOKIE, token)
    response.del_cookie(LOGIN_COOKIE, path="/login")
    log.info("console: %s logged in (%s)", user.name, user.role)
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    _console(request).sessions.close(request.cookies.get(SESSION_COOKIE, ""))
    response = _redirect("/login")
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


# ------------------------------------------------------------------------------------------------- pages


def _env_or_404(console: Console, env_id: str) -> pb.Environment:
    env = console.view.env(env_id)
    if env is None:
        raise web.HTTPNotFound(text=f"environment {env_id!r} not found")
    return env


async def overview_page(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    only = [env_id for env_id in request.query.get("only", "").split(",") if env_id]
    envs = pages.overview(console.view, console.routes(), only, console.listeners())
    return await render_streamed(request, "overview.html", page="overview", envs=envs)


async def overview_api(request: web.Request) -> web.Response:
    console = _console(request)
    overview = pages.overview(console.view, console.routes(), listeners=console.listeners())
    return web.json_response({"environments": overview})


def _env_detail(console: Console, env_id: str) -> dict[str, Any]:
    env = _env_or_404(console, env_id)
    routes = console.routes()
    urls = pages.urls_by_env(console.view, routes, console.listeners()).get(env_id, [])
    certificates = pages.certificates_by_env(console.view, routes).get(env_id, [])
    return pages.env_detail(console.view, env, urls, certificates)


async def env_page(request: web.Request) -> web.Response:
    console = _console(request)
    env_id = request.match_info["env_id"]
    return render(request, "env.html", page="env", env=_env_detail(console, env_id))


async def env_api(request: web.Request) -> web.Response:
    return web.json_response(_env_detail(_console(request), request.match_info["env_id"]))


async def nodes_page(request: web.Request) -> web.Response:
    return render(request, "nodes.html", page="nodes", nodes=pages.nodes(_console(request).view))


async def builds_page(request: web.Request) -> web.Response:
    return render(request, "builds.html", page="builds", builds=pages.builds(_console(request).view))


async def build_page(request: web.Request) -> web.Response:
    build_id = request.match_info["build_id"]
    build = _console(request).view.build(build_id)
    if build is None:
        raise web.HTTPNotFound(text=f"build {build_id!r} not found")
    return render(request, "build.html", page="build", build_id=build_id)


async def volumes_page(request: web.Request) -> web.Response:
    return render(request, "volumes.html", page="volumes", volumes=pages.volumes(_console(request).view))


async def events_page(request: web.Request) -> web.Response:
    return render(request, "events.html", page="events")


# ------------------------------------------------------------------------------------------------- actions


def _done(request: web.Request, where: str, notice: str, **payload: Any) -> web.StreamResponse:
    if _is_api(request):
        return web.json_response({"ok": True, "message": notice, **payload})
    _console(request).flash[_session(request).csrf] = notice
    return _redirect(where)


async def _form(request: web.Request) -> dict[str, str]:
    if request.content_type == "application/json":
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="body: not valid JSON") from None
        return {str(k): str(v) for k, v in body.items()} if isinstance(body, dict) else {}
    return {k: str(v) for k, v in (await request.post()).items()}


def _acting(request: web.Request) -> ActionContext:
    """The operator actions' context, acting as the session's user."""
    return _console(request).actions.acting_as(f"console:{_session(request).user}")


def _refused(request: web.Request, exc: ActionRefused) -> web.Response:
    return refuse(request, REFUSAL_STATUS[exc.kind], str(exc))


async def rollback_action(request: web.Request) -> web.StreamResponse:
    env_id = request.match_info["env_id"]
    form = await _form(request)
    try:
        done = await rollback(_acting(request), Rollback(env_id, form.get("release_id", "")))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = f"rolling back to v{done.release_version} (deployment {done.deployment_id})"
    return _done(request, f"/env/{env_id}", notice, deployment_id=done.deployment_id)


def _optional_int(form: dict[str, str], field: str) -> int | None:
    value = form.get(field, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise Invalid(field, "not a whole number", said=f"{field} {value!r}") from None


async def scale_action(request: web.Request) -> web.StreamResponse:
    env_id = request.match_info["env_id"]
    form = await _form(request)
    try:
        replicas, minimum, maximum = (_optional_int(form, field) for field in ("replicas", "min", "max"))
        done = await scale(_acting(request), Scale(env_id, replicas, minimum, maximum))
    except ActionRefused as exc:
        return _refused(request, exc)
    return _done(request, f"/env/{env_id}", f"scaled to {done.replicas} replica(s)")


async def secret_action(request: web.Request) -> web.StreamResponse:
    env_id = request.match_info["env_id"]
    form = await _form(request)
    name = form.get("name", "").strip()
    try:
        done = await set_secret(_acting(request), SetSecret(env_id, name, form.get("value", "")))
    except ActionRefused as exc:
        return _refused(request, exc)
    rollout = (
        f", rolling out (deployment {done.deployment_id})" if done.deployment_id else ", staged for the next deploy"
    )
    return _done(request, f"/env/{env_id}", f"secret {name} set{rollout}", deployment_id=done.deployment_id)


async def cancel_job_action(request: web.Request) -> web.StreamResponse:
    env_id, job_id = request.match_info["env_id"], request.match_info["job_id"]
    try:
        await cancel_job(_acting(request), CancelJob(job_id, env_id))
    except ActionRefused as exc:
        return _refused(request, exc)
    return _done(request, f"/env/{env_id}", f"job {job_id}: cancel requested")


async def node_action(request: web.Request) -> web.StreamResponse:
    node_id, change = request.match_info["node_id"], request.match_info["change"]
    if change not in NODE_CHANGES:
        raise web.HTTPNotFound()
    try:
        done = await edit_node(_acting(request), EditNode(node_id, NodeChange(change)))
    except ActionRefused as exc:
        return _refused(request, exc)
    return _done(request, "/nodes", f"node {node_id}: {change} {'done' if done.written else 'had nothing to do'}")


async def snapshot_action(request: web.Request) -> web.StreamResponse:
    volume_id = request.match_info["volume_id"]
    try:
        done = await take_snapshot(_acting(request), TakeSnapshot(volume_id, wait=0))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = f"snapshot {done.snapshot_id} of volume {volume_id} started"
    return _done(request, "/volumes", notice, snapshot_id=done.snapshot_id)


async def restore_action(request: web.Request) -> web.StreamResponse:
    volume_id = request.match_info["volume_id"]
    snapshot_id = (await _form(request)).get("snapshot_id", "")
    try:
        done = await restore_volume(_acting(request), RestoreVolume(volume_id, snapshot_id, wait=QUICK_ANSWER))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = "restored" if done.finished else "restoring (the volume shows RESTORING until it is done)"
    return _done(
        request, "/volumes", f"volume {volume_id} from snapshot {snapshot_id}: {notice}", finished=done.finished
    )


# ------------------------------------------------------------------------------------------------- SSE


async def _sse(request: web.Request, messages: AsyncIterator[tuple[str, str]]) -> web.StreamResponse:
    """Stream ``(event, data)`` pairs as Server-Sent Events until the client leaves or the console stops."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
    await response.prepare(request)
    await response.write(b"retry: 1000\n\n")
    source = aiter(messages)
    pending: asyncio.Task[tuple[str, str]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=HEARTBEAT)
            if not done:
                await response.write(b": keep-alive\n\n")
                continue
            try:
                event, data = pending.result()
            except StopAsyncIteration:
                break
            pending = None
            payload = "".join(f"data: {line}\n" for line in data.split("\n"))
            await response.write(f"event: {event}\n{payload}\n".encode())
    except ConnectionResetError:
        pass  # the browser left
    finally:
        if pending is not None:
            pending.cancel()
        with contextlib.suppress(Exception):
            await source.aclose()  # type: ignore[attr-defined]
    return response


async def live(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    page = request.query.get("page", "")
    only_env = request.query.get("env", "")
    kinds = pages.kinds_of_page(page)
    if not kinds:
        raise web.HTTPNotFound(text="page: unknown")

    async def changes() -> AsyncIterator[tuple[str, str]]:
        feed = console.view.subscribe(kinds)
        try:
            # The page compares this with the revision it was rendered at: a change in between refreshes it.
            yield "hello", json.dumps({"revision": pages.page_revision(console.view, page)})
            while True:
                changes = await feed.wait()
                routed = pages.routed_envs(console.routes()) if any(k == K.CERT for k, _ in changes) else None
                changed = pages.changed_envs(console.view, changes, routed)
                if only_env and changed is not None and only_env not in changed:
                    continue  # another env's change: not on this env's page
                yield "change", json.dumps({"envs": changed})
        finally:
            feed.close()

    return await _sse(request, changes())


def _log_line(line: AppLogLine) -> str:
    stamp = datetime.fromtimestamp(line.time_ns / 1e9, tz=UTC).strftime("%H:%M:%S")
    text = f"{stamp} {line.instance[-6:]} {line.stream}: {line.line}"
    return json.dumps({"text": text, "error": line.stream == "stderr"})


async def env_logs(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    env_id = _env_or_404(console, request.match_info["env_id"]).meta.id

    async def lines() -> AsyncIterator[tuple[str, str]]:
        while True:
            try:
                async for line in read_app_logs(console.conn, env_id, last=LOG_BACKLOG, follow=True, idle=0.2):
                    yield "line", _log_line(line)
                return
            except UnknownLogStream:
                await asyncio.sleep(LOG_STREAM_RETRY)  # the builds service creates it with the env

    return await _sse(request, lines())


async def build_logs(request: web.Request) -> web.StreamResponse:
    console = _console(request)
    build_id = request.match_info["build_id"]
    if console.view.build(build_id) is None:
        raise web.HTTPNotFound()

    async def lines() -> AsyncIterator[tuple[str, str]]:
        async for line in follow_build_log(console.conn, build_id):
            yield "line", json.dumps({"text": line, "error": False})

    return await _sse(request, lines())


async def events_stream(request: web.Request) -> web.StreamResponse:
    """The last events (of one env with ``?env=ID``), then new ones as they are published."""
    console = _console(request)
    only_env = request.query.get("env", "")

    async def lines() -> AsyncIterator[tuple[str, str]]:
        js = console.conn.js
        try:
            info = await js.stream_info(EVENTS_STREAM)
        except NotFoundError:
            return
        start = max(1, int(info.state.last_seq) - EVENTS_BACKLOG + 1)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        sub = await js.subscribe(
            EVENTS_SUBJECT_PREFIX + ">", stream=EVENTS_STREAM, ordered_consumer=True, config=config
        )
        try:
            while True:
                msg = await sub.next_msg(timeout=None)
                decoded = pb.Event.FromString(msg.data)
                if only_env and decoded.environment_id != only_env:
                    continue
                event = pages.event_line(console.view, decoded)
                text = f"{event['at']} {event['kind']} {event['scope']} {event['message']}"
                yield "line", json.dumps({"text": text, "error": event["severity"] != "info"})
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    return await _sse(request, lines())


# ------------------------------------------------------------------------------------------------- app


def make_app(console: Console) -> web.Application:
    app = web.Application(middlewares=[require_session], client_max_size=256 * 1024)
    app.on_response_prepare.append(security_headers)
    app[STATE] = console
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_get("/", overview_page)
    app.router.add_get("/api/overview", overview_api)
    app.router.add_get("/env/{env_id}", env_page)
    app.router.add_get("/api/env/{env_id}", env_api)
    app.router.add_get("/env/{env_id}/logs", env_logs)
    app.router.add_post("/env/{env_id}/rollback", rollback_action)
    app.router.add_post("/env/{env_id}/scale", scale_action)
    app.router.add_post("/env/{env_id}/secrets", secret_action)
    app.router.add_post("/env/{env_id}/jobs/{job_id}/cancel", cancel_job_action)
    app.router.add_get("/nodes", nodes_page)
    app.router.add_post("/nodes/{node_id}/{change}", node_action)
    app.router.add_get("/builds", builds_page)
    app.router.add_get("/builds/{build_id}", build_page)
    app.router.add_get("/builds/{build_id}/logs", build_logs)
    app.router.add_get("/volumes", volumes_page)
    app.router.add_post("/volumes/{volume_id}/snapshot", snapshot_action)
    app.router.add_post("/volumes/{volume_id}/restore", restore_action)
    app.router.add_get("/events", events_page)
    app.router.add_get("/events/stream", events_stream)
    app.router.add_get("/live", live)
    app.router.add_static("/static/", HERE / "static")
    return app
