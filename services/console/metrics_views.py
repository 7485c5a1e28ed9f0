"""The console's charts of the metrics history (docs/console.md, "Charts"): the env page's, the node page's
and the overview's sparklines; their fragments (``/env/<id>/charts``, ``/nodes/<id>/charts``) are what the
page fetches every 10 s to stay live; ``/api/env/<id>/metrics`` and ``/api/nodes/<id>/metrics`` the JSON."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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


CACHE_ATTRIBUTE = "_metrics_spark_cache"


async def env_history(console: Console, env_id: str, window: int) -> HR.History | None:
    try:
        return await HR.history(console.conn.nc, H.ENV, env_id, window, time.time())
    except (TimeoutError, nats.errors.Error, H.HistoryError) as exc:
        log.warning("metrics history of env %s not read: %s", env_id, exc)
        return None


async def env_charts_context(console: Console, env_id: str, window_name: str) -> dict[str, Any]:
    name, seconds = window_of(window_name)
    history = await env_history(console, env_id, seconds)
    return {
        "charts": env_charts(history, seconds) if history is not None else [],
        "window": name,
        "windows": [w for w, _ in CHART_WINDOWS],
        "charts_url": f"/env/{env_id}/charts?window={name}",
    }


async def node_charts_context(console: Console, node_id: str, window_name: str) -> dict[str, Any]:
    name, seconds = window_of(window_name)
    try:
        history: HR.History | None = await HR.history(console.conn.nc, H.NODE, node_id, seconds, time.time())
    except (TimeoutError, nats.errors.Error, H.HistoryError) as exc:
        log.warning("metrics history of node %s not read: %s", node_id, exc)
        history = None
    return {
        "charts": node_charts(history, seconds) if history is not None else [],
        "window": name,
        "windows": [w for w, _ in CHART_WINDOWS],
        "charts_url": f"/nodes/{node_id}/charts?window={name}",
    }


def window_problem(request: web.Request) -> str | None:
    """Why the ``window`` parameter is refused (None: absent, the default 1 h, or one of the windows)."""
    text = request.query.get("window", "")
    names = [name for name, _ in CHART_WINDOWS]
    if text and text not in names:
        return f"window {text!r}: expected one of {', '.join(names)}"
    return None


def _env_or_404(console: Console, env_id: str) -> pb.Environment:
    env = console.view.env(env_id)
    if env is None:
        raise web.HTTPNotFound(text=f"environment {env_id!r} not found")
    return env


def _node_or_404(console: Console, node_id: str) -> pb.Node:
    node = console.view.node(node_id)
    if node is None:
        raise web.HTTPNotFound(text=f"node {node_id!r} not found")
    return node


async def env_charts_fragment(request: web.Request) -> web.Response:
    """The charts region alone (the page's live refresh every 10 s)."""
    console = console_of(request)
    env_id = request.match_info["env_id"]
    _env_or_404(console, env_id)
    if (problem := window_problem(request)) is not None:
        return refuse(request, 400, problem)
    context = await env_charts_context(console, env_id, request.query.get("window", ""))
    return render(request, "_charts.html", **context)


async def env_metrics_api(request: web.Request) -> web.Response:
    console = console_of(request)
    env_id = request.match_info["env_id"]
    _env_or_404(console, env_id)
    if (problem := window_problem(request)) is not None:
        return refuse(request, 400, problem)
    _, seconds = window_of(request.query.get("window", ""))
    history = await env_history(console, env_id, seconds)
    if history is None:
        return web.json_response({"error": "the metrics history did not answer"}, status=503)
    return web.json_response(history.as_dict())


async def node_page(request: web.Request) -> web.Response:
    console = console_of(request)
    node_id = request.match_info["node_id"]
    node = _node_or_404(console, node_id)
    if (problem := window_problem(request)) is not None:
        return refuse(request, 400, problem)
    context = await node_charts_context(console, node_id, request.query.get("window", ""))
    heartbeat = console_live_heartbeat(console, node_id)
    return render(request, "node.html", page="nodes", node=node_summary(console, node, heartbeat), **context)


async def node_charts_fragment(request: web.Request) -> web.Response:
    console = console_of(request)
    node_id = request.match_info["node_id"]
    _node_or_404(console, node_id)
    if (problem := window_problem(request)) is not None:
        return refuse(request, 400, problem)
    context = await node_charts_context(console, node_id, request.query.get("window", ""))
    return render(request, "_charts.html", **context)


async def node_metrics_api(request: web.Request) -> web.Response:
    console = console_of(request)
    node_id = request.match_info["node_id"]
    _node_or_404(console, node_id)
    if (problem := window_problem(request)) is not None:
        return refuse(request, 400, problem)
    _, seconds = window_of(request.query.get("window", ""))
    history = await HR.history(console.conn.nc, H.NODE, node_id, seconds, time.time())
    return web.json_response(history.as_dict())


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
    """env id → its sparkline of the last 2 h (requests and 5xx per second), from one cached read."""
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
    out: dict[str, Markup] = {}
    for env_id in env_ids:
        slots = H.dense(cache.points.get(env_id, []), start, end, H.DOWN_SPAN)
        requests = [p.rps if p is not None else None for _, p in slots]
        errors = [H.rate(p, "responses_5xx") if p is not None else None for _, p in slots]
        out[env_id] = chart_sparkline(requests, errors, "last 2 hours")
    return out
