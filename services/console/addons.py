"""The console's managed databases (docs/addons.md): ``/addons`` lists them by project — engine, version,
state, private address, attached envs and, for PostgreSQL, the recoverable window its instance last
reported — with the forms that call the same operator actions as ``zattera addons``: create
(``POST /addons/create``), attach, detach and restore as a point-in-time fork
(``POST /env/{database env id}/addon/attach|detach|restore``). Like every POST: the session's CSRF token and
a role that may act (``login.py``; a project member's role is checked on the database's env path,
``teams.py``). No password is shown or returned: they are sealed secrets of the database's env.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from services.console.forms import _acting, _done, _form, _refused
from services.console.handling import console_of, is_api, render
from shared.actions.addon_attach import AttachAddon, attach_addon, detach_addon
from shared.actions.addon_restore import backup_status, restore_addon
from shared.actions.addons import AddonInfo, CreateAddon, RestoreAddon, addon_env, create_addon, info_of, list_addons
from shared.actions.context import ActionContext
from shared.actions.names import env_path
from shared.actions.refusals import ActionRefused, Invalid, NotFound
from shared.addons import spec as addon
from shared.clock import parse_instant


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if epoch else ""


async def addon_row(ctx: ActionContext, info: AddonInfo) -> dict[str, Any]:
    """One database as the page (and ``/api/addons``) shows it."""
    row: dict[str, Any] = dataclasses.asdict(info)
    row["window"] = None
    row["backups"] = []
    if info.engine == addon.POSTGRES:
        env = ctx.view.env(info.env_id)
        status = await backup_status(ctx, env) if env is not None else None
        if status is not None:
            row["window"] = {
                "start": status.window_start,
                "end": status.window_end,
                "start_utc": _utc(status.window_start),
                "end_utc": _utc(status.window_end),
                "reported_at": status.reported_at,
                "failed": status.archive_failures,
            }
            row["backups"] = [dataclasses.asdict(b) for b in status.backups]
    database = ctx.view.env(info.env_id)
    project_id = database.project_id if database is not None else ""
    row["consumers"] = sorted(
        path
        for e in ctx.view.envs()
        if e.project_id == project_id
        and addon.addon_of(e) is None
        and (path := env_path(ctx.view, e)) not in info.attached_to
    )
    return row


async def addons_page(request: web.Request) -> web.Response:
    """``/addons`` (``?project=NAME`` for one project) and ``/api/addons``."""
    console = console_of(request)
    ctx = console.actions
    project = request.query.get("project", "").strip()
    try:
        infos = list_addons(console.view, project)
    except ActionRefused as exc:
        return _refused(request, exc)
    rows = [await addon_row(ctx, info) for info in sorted(infos, key=lambda i: (i.project, i.name))]
    if is_api(request):
        return web.json_response({"addons": rows})
    projects = sorted(p.name for p in console.view.all("project"))
    return render(
        request,
        "addons.html",
        page="addons",
        addons=rows,
        project=project,
        projects=projects,
        engines=sorted(addon.ENGINES),
    )


async def create_addon_action(request: web.Request) -> web.StreamResponse:
    form = await _form(request)
    request_ = CreateAddon(
        form.get("engine", "").strip(),
        form.get("name", "").strip(),
        form.get("project", "").strip(),
        form.get("version", "").strip(),
    )
    try:
        done = await create_addon(_acting(request), request_)
    except ActionRefused as exc:
        return _refused(request, exc)
    info = done.info
    notice = f"database {info.project}/{info.name} ({info.engine} {info.version}) created: starting at {info.address}"
    return _done(request, "/addons", notice, env_id=info.env_id, deployment_id=done.deployment_id)


def _database(request: web.Request) -> AddonInfo:
    """The database whose env the path names (``/env/{env_id}/addon/...``)."""
    view = console_of(request).view
    env = view.env(request.match_info["env_id"])
    if env is None or addon.addon_of(env) is None or env.name != addon.ENV_NAME:
        raise NotFound(f"no database with env {request.match_info['env_id']}", field="env_id")
    project = view.project(env.project_id)
    app = view.app(env.app_id)
    assert project is not None and app is not None
    addon_env(view, project, app.name)
    return info_of(view, env)


def _parse_time(value: str) -> float:
    try:
        return parse_instant(value)
    except ValueError as exc:
        raise Invalid("to_time", str(exc)) from None


async def addon_action(request: web.Request) -> web.StreamResponse:
    """``POST /env/{env_id}/addon/attach|detach`` (form ``env``: the consumer, id or project/app/env; ``deploy=0``
    stages the change for the consumer's next deploy) and
    ``…/restore`` (``as_name``, ``to_time`` or ``latest``)."""
    verb = request.match_info["verb"]
    if verb not in ("attach", "detach", "restore"):
        raise web.HTTPNotFound(text=f"no add-on action {verb!r}")
    form = await _form(request)
    try:
        info = _database(request)
        ctx = _acting(request)
        if verb == "restore":
            latest = form.get("latest", "") in ("1", "on", "true")
            to_time = None if latest else _parse_time(form.get("to_time", ""))
            restored = await restore_addon(
                ctx, RestoreAddon(info.name, info.project, form.get("as_name", "").strip(), to_time)
            )
            fork = restored.info
            notice = f"restoring {fork.project}/{fork.name} from {info.project}/{info.name} (a new database)"
            return _done(request, "/addons", notice, env_id=fork.env_id, deployment_id=restored.deployment_id)
        consumer = form.get("env", "").strip()
        if not consumer:
            raise Invalid("env", "name the env (project/app/env)")
        act = attach_addon if verb == "attach" else detach_addon
        deploy = form.get("deploy", "1") not in ("0", "false", "off")  # "0": staged for the next deploy
        changed = await act(ctx, AttachAddon(info.name, consumer, deploy=deploy))
    except ActionRefused as exc:
        return _refused(request, exc)
    where = "to" if verb == "attach" else "from"
    notice = f"database {info.name} {verb}ed {where} {changed.env}" + (
        f", rolling out (deployment {changed.deployment_id})" if changed.deployment_id else ""
    )
    return _done(request, "/addons", notice, deployment_id=changed.deployment_id)
