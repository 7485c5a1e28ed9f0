"""Teams in the console (docs/teams.md): project members see and act on their projects only; API tokens on the
JSON API; the admins' page of users, grants and tokens.

A console user whose name is a team user's (``zattera users add``) and who is not a team admin is **scoped**:
the record's grants (read at every request, so a removed grant applies at once) decide. ``Authorization:
Bearer ztk1_…`` on ``/api/…`` is an API token: its record (by the name in the credential it wraps) must hold
``sha256(token)`` (compared with :func:`hmac.compare_digest`), not be revoked nor expired; it acts with its
role on its one project. A scoped request reaches only the overview (its projects' environments) and the pages,
API and actions of an environment of a granted project (actions: owner or deployer); anything else is refused.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from services.console.handling import SESSION, console_of, is_api, redirect_to, refuse, render, session_of
from services.console.overview import render_overview
from services.console.pages import overview as overview_rows
from shared.connection import Connection
from shared.console_users import ADMIN, VIEWER
from shared.security.creds import _JWT_BLOCK
from shared.security.nkeyjwt import decode_claims
from shared.teams import (
    DEPLOYER,
    OWNER,
    ROLES,
    TEAMS_BUCKET,
    TOKEN_USER_PREFIX,
    TeamError,
    User,
    decode_token,
    token_matches,
    user_key,
)
from shared.teams_store import all_records, load_token, load_user, save_user

from .auth import Session

SCOPE = web.RequestKey("team_scope", dict)
"""project id → role of a scoped request (absent: not scoped)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ENV_PATH = re.compile(r"^/(?:api/)?env/([^/]+)(?:/.*)?$")
ACTING = (OWNER, DEPLOYER)


async def bearer_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A JSON API request carrying an API token: its session and scope for this request only."""
    token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    console = console_of(request)
    why = "not a valid API token"
    try:
        match = _JWT_BLOCK.search(decode_token(token))
        name = str(decode_claims(match.group(1)).get("name", "")) if match else ""
    except (TeamError, ValueError):
        name = ""
    record = None
    if name.startswith(TOKEN_USER_PREFIX):
        try:
            record = await load_token(console.conn.js, name[len(TOKEN_USER_PREFIX) :])
        except (TeamError, BucketNotFoundError):
            record = None
    if record is not None and token_matches(token, record.sha256):
        why = record.usable(time.time())
        if not why:
            role = ADMIN if record.role in ACTING else VIEWER
            request[SESSION] = Session(name, role, secrets.token_urlsafe(16), record.expires_at)
            request[SCOPE] = {record.project_id: record.role}
            return await handler(request)
    return web.json_response({"error": f"refused: {why}"}, status=401)


async def _scope_of(request: web.Request) -> dict[str, str] | None:
    scoped = request.get(SCOPE)
    if scoped is not None:
        return {str(k): str(v) for k, v in scoped.items()}
    session = request.get(SESSION)
    if session is None:
        return None
    kv = await _teams_bucket(console_of(request).conn)
    if kv is None:
        return None
    try:
        entry = await kv.get(user_key(session.user))
    except KeyNotFoundError:
        return None
    user = User.from_json(entry.value) if entry.value else None
    if user is None or user.admin:
        return None
    return dict(user.grants)


_BUCKETS: dict[int, tuple[Connection, KeyValue | None, float]] = {}
"""By connection (held, so its id is not reused): the bucket, or None and when it was found missing."""
ABSENT_RECHECK = 5.0
"""An open cluster has no teams bucket: asked again after this long, not at every request."""


async def _teams_bucket(conn: Connection) -> KeyValue | None:
    """The ``zattera-teams`` bucket (looked up once per connection), or None where there is none."""
    held = _BUCKETS.get(id(conn))
    if held is not None and held[0] is conn and (held[1] is not None or time.monotonic() - held[2] < ABSENT_RECHECK):
        return held[1]
    try:
        found: KeyValue | None = await conn.js.key_value(TEAMS_BUCKET)
    except BucketNotFoundError:
        found = None
    _BUCKETS[id(conn)] = (conn, found, time.monotonic())
    return found


@web.middleware
async def scope_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Narrows a scoped request to its projects (the module docstring); unscoped requests pass."""
    if request.path.startswith(("/login", "/static/", "/hooks/", "/git/")) or request.path == "/logout":
        return await handler(request)
    scope = await _scope_of(request)
    if scope is None:
        return await handler(request)
    console = console_of(request)
    if request.path in ("/", "/api/overview"):
        return await _scoped_overview(request, scope)
    match = _ENV_PATH.match(request.path)
    if match:
        env = console.view.env(match.group(1))
        role = scope.get(env.project_id, "") if env is not None else ""
        if not role:
            return refuse(request, 404, f"no environment {match.group(1)}")
        if request.method != "GET" and role not in ACTING:
            return refuse(request, 403, f"refused: the {role} role of this project cannot act")
        return await handler(request)
    return refuse(request, 403, "refused: project members see their projects' environments only (docs/teams.md)")


async def _scoped_overview(request: web.Request, scope: dict[str, str]) -> web.StreamResponse:
    console = console_of(request)
    only = [e.meta.id for e in console.view.envs() if e.project_id in scope]
    if is_api(request):
        envs = overview_rows(console.view, console.routes(), only, console.listeners()) if only else []
        return web.json_response({"environments": envs, "projects": scope})
    return await render_overview(request, only, scoped=True)


def _admin_only(request: web.Request) -> web.StreamResponse | None:
    if session_of(request).role != ADMIN:
        return refuse(request, 403, "refused: admins only")
    return None


async def teams_page(request: web.Request) -> web.StreamResponse:
    """Users, their grants, tokens (never a token or its hash); forms to grant and take back a role."""
    if (refused := _admin_only(request)) is not None:
        return refused
    console = console_of(request)
    try:
        users, tokens = await all_records(console.conn.nc, console.conn.js)
    except TeamError as exc:
        return refuse(request, 404, str(exc))
    names = {p.meta.id: p.name for p in console.view.all("project")}
    rows = [
        {"name": u.name, "admin": u.admin, "grants": [(names.get(p, p), p, r) for p, r in sorted(u.grants.items())]}
        for u in users
    ]
    if is_api(request):
        return web.json_response({"users": rows, "tokens": [t.public() for t in tokens]})
    projects = sorted(names.items(), key=lambda item: item[1])
    return render(request, "teams.html", page="", users=rows, tokens=tokens, projects=projects, roles=ROLES)


async def grant_action(request: web.Request) -> web.StreamResponse:
    """POST /admin/teams/grant: ``user``, ``project`` (id), ``role`` ("" takes the grant back)."""
    if (refused := _admin_only(request)) is not None:
        return refused
    console = console_of(request)
    form = await request.post()
    name, project, role = str(form.get("user", "")), str(form.get("project", "")), str(form.get("role", ""))
    if console.view.project(project) is None:
        return refuse(request, 400, f"project: no project {project!r}")
    if role and role not in ROLES:
        return refuse(request, 400, f"role: must be one of {', '.join(ROLES)}")
    user = await load_user(console.conn.js, name)
    if user is None:
        return refuse(request, 400, f"user: no team user {name!r}")
    if role:
        user.grants[project] = role
    else:
        user.grants.pop(project, None)
    await save_user(console.conn.js, user)
    return redirect_to("/admin/teams")
