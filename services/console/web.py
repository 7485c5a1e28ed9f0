"""The console's HTTP side (aiohttp): server-rendered pages, a small JSON API and SSE streams.

Every page and API call needs a session (``auth.py``); every POST needs the session's CSRF token (form field
``csrf`` or header ``X-CSRF-Token``) and the admin role. Live updates are Server-Sent Events: ``/live`` says
"something this page shows changed" (fed by the state view's change notifications) and the browser fetches
the page again and swaps its live regions; logs, build logs and events stream their lines.

The handlers live by concern: ``handling.py`` (what they share), ``login.py``, ``views.py``, ``forms.py``,
``streams.py``; this module composes the application.
"""

from __future__ import annotations

from aiohttp import web

from services.console.addons import addon_action, addons_page, create_addon_action
from services.console.forms import (
    canary_action,
    cancel_job_action,
    node_action,
    restore_action,
    rollback_action,
    scale_action,
    secret_action,
    snapshot_action,
)
from services.console.handling import HERE, STATE, Console
from services.console.hooks import webhook
from services.console.login import login, login_page, logout, require_session, security_headers
from services.console.metrics_views import (
    env_charts_fragment,
    env_metrics_api,
    node_charts_fragment,
    node_metrics_api,
    node_page,
)
from services.console.streams import build_logs, env_logs, events_stream, live
from services.console.teams import grant_action, scope_guard, teams_page
from services.console.views import (
    audit_page,
    build_page,
    builds_page,
    env_api,
    env_page,
    events_page,
    nodes_page,
    overview_api,
    overview_page,
    volumes_page,
)


async def git_request(request: web.Request) -> web.StreamResponse:
    """``git push`` / fetch over smart HTTP (services/console/git.py)."""
    git = request.app[STATE].git
    if git is None:
        return web.Response(status=404, text="git push is not served by this console\n")
    response: web.StreamResponse = await git.handle(request)
    return response


def make_app(console: Console) -> web.Application:
    app = web.Application(middlewares=[require_session, scope_guard], client_max_size=256 * 1024)
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
    app.router.add_post("/env/{env_id}/deployments/{deployment_id}/{verb}", canary_action)
    app.router.add_get("/nodes", nodes_page)
    app.router.add_post("/nodes/{node_id}/{change}", node_action)
    app.router.add_get("/builds", builds_page)
    app.router.add_get("/builds/{build_id}", build_page)
    app.router.add_route("*", "/git/{tail:.*}", git_request)
    app.router.add_get("/builds/{build_id}/logs", build_logs)
    app.router.add_get("/volumes", volumes_page)
    app.router.add_post("/volumes/{volume_id}/snapshot", snapshot_action)
    app.router.add_post("/volumes/{volume_id}/restore", restore_action)
    app.router.add_get("/events", events_page)
    app.router.add_get("/events/stream", events_stream)
    app.router.add_get("/audit", audit_page)
    app.router.add_get("/api/audit", audit_page)
    app.router.add_get("/env/{env_id}/charts", env_charts_fragment)
    app.router.add_get("/api/env/{env_id}/metrics", env_metrics_api)
    app.router.add_get("/nodes/{node_id}", node_page)
    app.router.add_get("/nodes/{node_id}/charts", node_charts_fragment)
    app.router.add_get("/api/nodes/{node_id}/metrics", node_metrics_api)
    app.router.add_get("/live", live)
    app.router.add_static("/static/", HERE / "static")
    app.router.add_post("/hooks/{provider}/{hook_id}", webhook)
    app.router.add_get("/admin/teams", teams_page)
    app.router.add_post("/admin/teams/grant", grant_action)
    app.router.add_get("/addons", addons_page)
    app.router.add_get("/api/addons", addons_page)
    app.router.add_post("/addons/create", create_addon_action)
    app.router.add_post("/env/{env_id}/addon/{verb}", addon_action)
    return app
