"""The console's charts of the metrics history (docs/console.md, "Charts"): the env page's, the node page's
and the overview's sparklines; their fragments (``/env/<id>/charts``, ``/nodes/<id>/charts``) are what the
page fetches every 10 s to stay live; ``/api/env/<id>/metrics`` and ``/api/nodes/<id>/metrics`` the JSON."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from aiohttp import web
from markupsafe import Markup
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.console.charts import WINDOWS as CHART_WINDOWS
from services.console.charts import env_charts, node_charts, window_of
from services.console.charts import sparkline as chart_sparkline
from services.console.handling import Console, console_of, refuse, render
from shared import history as H
from shared import history_read as HR

log = logging.getLogger(__name__)

SPARK_WINDOW = 2 * 3600
"""The overview's sparklines: the last 2 hours of 5-min points (one read for every env)."""
SPARK_CACHE = 30.0
"""Seconds the overview's sparkline data is reused (a page of 1,000 envs reads it once per 30 s)."""


@dataclass
class _SparkCache:
    at: float = 0.0
    points: dict[str, list[cpb.MetricPoint]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    drawn: dict[str, Markup] = field(default_factory=dict)
    """env id → its sparkline, drawn once for ``drawn_for``."""
    drawn_for: tuple[float, int, int] = (0.0, 0, 0)
    """The read (``at``) and the slots (first, last) ``drawn`` is of: a page load redraws nothing until either moves."""


CACHE_ATTRIBUTE = "_metrics_spark_cache"


@dataclass(frozen=True)
class _Charted:
    """What differs between the env's and a node's charts: the history kind, the URL path, the charts, how
    the object is found (404 otherwise)."""

    kind: str
    path: str
    noun: str
    charts: Callable[[HR.History, int], list[Markup]]
    find: Callable[[Console, str], Any]


ENV_CHARTED = _Charted(H.ENV, "/env", "environment", env_charts, lambda console, ident: console.view.env(ident))
NODE_CHARTED = _Charted(H.NODE, "/nodes", "node", node_charts, lambda console, ident: console.view.node(ident))


def found_or_404(console: Console, charted: _Charted, ident: str) -> Any:
    found = charted.find(console, ident)
    if found is None:
        raise web.HTTPNotFound(text=f"{charted.noun} {ident!r} not found")
    return found


def env_or_404(console: Console, env_id: str) -> pb.Environment:
    env: pb.Environment = found_or_404(console, ENV_CHARTED, env_id)
    return env


async def read_history(console: Console, kind: str, ident: str, window: int) -> HR.History | None:
    """The series of an env or node (None, logged, when the history does not answer)."""
    try:
        return await HR.history(console.conn.nc, kind, ident, window, time.time())
    except (TimeoutError, nats.errors.Error, H.HistoryError) as exc:
        log.warning("metrics history of %s %s not read: %s", kind, ident, exc)
        return None


async def charts_context(console: Console, charted: _Charted, ident: str, window_name: str) -> dict[str, Any]:
    name, seconds = window_of(window_name)
    history = await read_history(console, charted.kind, ident, seconds)
    return {
        "charts": charted.charts(history, seconds) if history is not None else [],
        "window": name,
        "windows": [w for w, _ in CHART_WINDOWS],
        "charts_url": f"{charted.path}/{ident}/charts?window={name}",
    }


async def env_charts_context(console: Console, env_id: str, window_name: str) -> dict[str, Any]:
    return await charts_context(console, ENV_CHARTED, env_id, window_name)


def window_problem(request: web.Request) -> str | None:
    """Why the ``window`` parameter is refused (None: absent, the default 1 h, or one of the windows)."""
    text = request.query.get("window", "")
    names = [name for name, _ in CHART_WINDOWS]
    if text and text not in names:
        return f"window {text!r}: expected one of {', '.join(names)}"
    return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _checked(
    charted: _Charted, param: str, then: Callable[[web.Request, Console, str], Awaitable[web.Response]]
) -> Handler:
    """A handler of ``charted``'s object named by the route's ``param``: 404 when unknown, 400 for a bad window,
    else ``then``."""

    async def handler(request: web.Request) -> web.Response:
        console = console_of(request)
        ident = request.match_info[param]
        found_or_404(console, charted, ident)
        if (problem := window_problem(request)) is not None:
            return refuse(request, 400, problem)
        return await then(request, console, ident)

    return handler


def charts_fragment(charted: _Charted, param: str) -> Handler:
    """The charts region alone (the page's live refresh every 10 s)."""

    async def fragment(request: web.Request, console: Console, ident: str) -> web.Response:
        context = await charts_context(console, charted, ident, request.query.get("window", ""))
        return render(request, "_charts.html", **context)

    return _checked(charted, param, fragment)


def metrics_api(charted: _Charted, param: str) -> Handler:
    """The series as JSON; an env's with its replicas' (every one: the page draws at most
    ``REPLICA_LINES``)."""

    async def api(request: web.Request, console: Console, ident: str) -> web.Response:
        _, seconds = window_of(request.query.get("window", ""))
        history = await read_history(console, charted.kind, ident, seconds)
        if history is None:
            return web.json_response({"error": "the metrics history did not answer"}, status=503)
        extra = HR.replicas_as_dict(history) if charted.kind == H.ENV else {}
        return web.json_response({**history.as_dict(), **extra})

    return _checked(charted, param, api)


env_charts_fragment = charts_fragment(ENV_CHARTED, "env_id")
env_metrics_api = metrics_api(ENV_CHARTED, "env_id")
node_charts_fragment = charts_fragment(NODE_CHARTED, "node_id")
node_metrics_api = metrics_api(NODE_CHARTED, "node_id")


async def _node_page(request: web.Request, console: Console, node_id: str) -> web.Response:
    context = await charts_context(console, NODE_CHARTED, node_id, request.query.get("window", ""))
    summary = node_summary(console, console.view.node(node_id) or pb.Node(), console_live_heartbeat(console, node_id))
    return render(request, "node.html", page="nodes", node=summary, **context)


node_page = _checked(NODE_CHARTED, "node_id", _node_page)


def console_live_heartbeat(console: Console, node_id: str) -> cpb.Heartbeat | None:
    live = getattr(console, "live", None)
    if live is None:
        return None
    with contextlib.suppress(Exception):
        heartbeat: cpb.Heartbeat | None = live.node_heartbeat(node_id)
        return heartbeat
    return None


def node_summary(console: Console, node: pb.Node, heartbeat: cpb.Heartbeat | None) -> dict[str, Any]:
    gib = 1_073_741_824
    summary: dict[str, Any] = {
        "id": node.meta.id,
        "name": node.name or node.meta.id,
        "status": pb.NodeStatus.Name(node.status).removeprefix("NODE_STATUS_").lower(),
        "schedulable": node.schedulable,
        "replicas": len(console.view.assignments_by_node(node.meta.id)),
        "labels": ", ".join(f"{k}={v}" for k, v in sorted(node.labels.items())),
        "now": None,
    }
    if heartbeat is not None:
        summary["now"] = {
            "cpu": f"{heartbeat.cpu_percent:.0f} %",
            "memory": f"{heartbeat.memory_used_bytes / gib:.1f} / {heartbeat.memory_total_bytes / gib:.1f} GiB",
            "disk": f"{heartbeat.disk_used_bytes / gib:.1f} / {heartbeat.disk_total_bytes / gib:.1f} GiB",
            "instances": len(heartbeat.instances),
        }
    return summary


async def overview_sparklines(console: Console, env_ids: list[str]) -> dict[str, Markup]:
    """env id → its sparkline of the last 2 h (requests and 5xx per second), from one cached read, each drawn
    once per read."""
    cache: _SparkCache | None = getattr(console, CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = _SparkCache()
        setattr(console, CACHE_ATTRIBUTE, cache)  # one per console (its lifetime)
    now = time.time()
    async with cache.lock:
        if now - cache.at > SPARK_CACHE:
            since = H.bucket_of(now - SPARK_WINDOW, H.DOWN_SPAN)
            points: dict[str, list[cpb.MetricPoint]] = {}
            try:
                msgs = await HR.read_messages(
                    console.conn.nc, H.METRICS_5M_STREAM, H.subject(H.DOWN, H.ENV, "*"), since, limit=200_000
                )
            except nats.errors.NoRespondersError:
                msgs = []  # nothing recorded yet (the metrics streams are created by the recorder)
            except (TimeoutError, nats.errors.Error, H.HistoryError) as exc:
                log.warning("overview sparklines not read: %s", exc)
                msgs = []
            for msg in msgs:
                env_id = (msg.headers or {}).get("Nats-Subject", "").rpartition(".")[2]
                with contextlib.suppress(Exception):
                    points.setdefault(env_id, []).append(cpb.MetricPoint.FromString(msg.data))
            cache.points, cache.at = points, now
    start = H.bucket_of(now - SPARK_WINDOW, H.DOWN_SPAN)
    end = H.bucket_of(now, H.DOWN_SPAN)
    if cache.drawn_for != (cache.at, start, end):
        cache.drawn, cache.drawn_for = {}, (cache.at, start, end)
    out: dict[str, Markup] = {}
    for env_id in env_ids:
        if env_id not in cache.drawn:
            cache.drawn[env_id] = _spark(cache.points.get(env_id, []), start, end)
        out[env_id] = cache.drawn[env_id]
    return out


def _spark(points: list[cpb.MetricPoint], start: int, end: int) -> Markup:
    """The sparkline of an env's points in the slots ``start``…``end`` (a slot without one: no requests, as the
    recorder writes nothing for an idle env)."""
    slots = H.dense(points, start, end, H.DOWN_SPAN)
    requests = [p.rps if p is not None else None for _, p in slots]
    errors = [H.rate(p, "responses_5xx") if p is not None else None for _, p in slots]
    return chart_sparkline(requests, errors, "last 2 hours")
