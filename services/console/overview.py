"""The overview page (the cluster's envs as project cards with their sparklines), for an operator and, narrowed
to its projects, for a project member (``teams.py``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.console.handling import console_of, render_streamed
from services.console.metrics_views import overview_sparklines
from services.console.pages import overview
from shared.backup.status import backup_status, describe
from shared.notify_status import failing_channels


async def render_overview(request: web.Request, only: list[str], *, scoped: bool = False) -> web.StreamResponse:
    """The overview of the envs ``only`` names (none named: every env, unless ``scoped``: a project member's,
    which shows only its projects' envs and none of the cluster's notices)."""
    console = console_of(request)
    envs = overview(console.view, console.routes(), only, console.listeners()) if only or not scoped else []
    for row in envs:  # grouped by project on the page (issue 40)
        row.setdefault("project", row["path"].split("/", 1)[0])
    failing: list[str] = []
    channels: list[Any] = []
    if not scoped:
        backups = backup_status(console.view)
        failing = describe(backups) if backups.failing else []
        channels = failing_channels(console.view)
    sparks = await overview_sparklines(console, [e["id"] for e in envs])
    return await render_streamed(
        request,
        "overview.html",
        page="overview",
        envs=envs,
        backups_failing=failing,
        channels_failing=channels,
        sparks=sparks,
    )
