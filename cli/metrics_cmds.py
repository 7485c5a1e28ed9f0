"""``zattera metrics --env E [--replicas] | --node N | --proxy P [--since 1h] [--json]``: the metrics history the
cluster keeps (docs/observability.md, "History"), as a compact table with a unicode sparkline per figure (per
replica with ``--replicas``), or the series as JSON for scripts."""

from __future__ import annotations

import json as jsonlib
import time
from collections.abc import Sequence

import typer

from cli.client import control, fail, run
from shared import history as H
from shared import history_read as HR
from shared.actions.names import env_path, resolve_env

SPARK_WIDTH = 60

ENV_ROWS: tuple[tuple[str, str, bool, str], ...] = (
    ("requests/s", "rps", False, "{:.1f}"),
    ("2xx/s", "responses_2xx", True, "{:.1f}"),
    ("4xx/s", "responses_4xx", True, "{:.2f}"),
    ("5xx/s", "responses_5xx", True, "{:.2f}"),
    ("p50 ms", "latency_p50_ms", False, "{:.0f}"),
    ("p95 ms", "latency_p95_ms", False, "{:.0f}"),
    ("p99 ms", "latency_p99_ms", False, "{:.0f}"),
    ("in flight", "inflight", False, "{:.1f}"),
    ("desired", "desired", False, "{:.0f}"),
    ("running", "running", False, "{:.0f}"),
    ("cpu %", "cpu_percent", False, "{:.1f}"),
    ("memory MiB", "memory_bytes", False, "mib"),
)
NODE_ROWS: tuple[tuple[str, str, bool, str], ...] = (
    ("cpu %", "cpu_percent", False, "{:.1f}"),
    ("memory MiB", "memory_bytes", False, "mib"),
    ("disk GiB", "disk_used_bytes", False, "gib"),
    ("instances", "instances", False, "{:.0f}"),
)
PROXY_ROWS: tuple[tuple[str, str, bool, str], ...] = (
    ("requests/s", "rps", False, "{:.1f}"),
    ("connections", "connections", False, "{:.0f}"),
)


def _fmt(value: float | None, style: str) -> str:
    if value is None:
        return "-"
    if style == "mib":
        return f"{value / 1_048_576:.0f}"
    if style == "gib":
        return f"{value / 1_073_741_824:.1f}"
    return style.format(value)


def squeeze(values: Sequence[float | None], width: int = SPARK_WIDTH) -> list[float | None]:
    """At most ``width`` values: each the mean of its group (unknown when the whole group is)."""
    if len(values) <= width:
        return list(values)
    out: list[float | None] = []
    for i in range(width):
        group = [v for v in values[i * len(values) // width : (i + 1) * len(values) // width] if v is not None]
        out.append(sum(group) / len(group) if group else None)
    return out


def table(history: HR.History, label: str, window: str) -> list[str]:
    rows = {H.ENV: ENV_ROWS, H.NODE: NODE_ROWS, H.PROXY: PROXY_ROWS}[history.kind]
    lines = [f"{history.kind} {label} · last {window} · one point per {history.span} s"]
    lines.append(f"{'':<12} {'last':>8} {'min':>8} {'max':>8}  history")
    for title, name, per_second, style in rows:
        values = history.values(name, per_second=per_second)
        known = [v for v in values if v is not None]
        last = known[-1] if known else None
        low = min(known) if known else None
        high = max(known) if known else None
        spark = HR.sparkline(squeeze(values))
        lines.append(
            f"{title:<12} {_fmt(last, style):>8} {_fmt(low, style):>8} {_fmt(high, style):>8}  {spark}".rstrip()
        )
    for mark in history.marks:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(mark.time))
        lines.append(f"  {at} {mark.kind:<20} {mark.text}")
    return lines


def replica_table(history: HR.History, label: str, window: str) -> list[str]:
    """Per replica (at most ``REPLICA_LINES``, those running last first): CPU and memory, last/min/max and a
    sparkline; a replica that stopped within the window says so."""
    every = HR.replica_series(history)
    shown, left_out = HR.pick_replicas(every)
    lines = [f"env {label} · last {window} · one point per {history.span} s · CPU and memory per replica"]
    if not every:
        return [*lines, "no replica reported in this window"]
    lines.append(f"{'replica':<28} {'':<10} {'last':>8} {'min':>8} {'max':>8}  history")
    end = len(history.slots) - 1
    for replica in shown:
        name = replica.label + ("" if replica.last_seen >= end - 1 else " (stopped)")
        for title, values, style in (
            ("cpu %", replica.cpu_percent, "{:.1f}"),
            ("memory MiB", replica.memory_bytes, "mib"),
        ):
            known = [v for v in values if v is not None]
            last, low, high = (known[-1], min(known), max(known)) if known else (None, None, None)
            spark = HR.sparkline(squeeze(values))
            figures = f"{_fmt(last, style):>8} {_fmt(low, style):>8} {_fmt(high, style):>8}"
            lines.append(f"{name:<28} {title:<10} {figures}  {spark}".rstrip())
            name = ""
    if left_out:
        lines.append(f"{left_out} more replica(s) not shown (--json lists them all)")
    return lines


def metrics(
    env: str = typer.Option("", "--env", help="an environment (id or project/app/env)"),
    node: str = typer.Option("", "--node", help="a node (id or name)"),
    proxy: str = typer.Option("", "--proxy", help="a proxy id"),
    since: str = typer.Option("1h", "--since", help="how far back: 15m, 1h, 24h, 7d (at most 30d)"),
    json: bool = typer.Option(False, "--json", help="the series as one JSON object"),
    replicas: bool = typer.Option(False, "--replicas", help="an env's CPU and memory per replica"),
) -> None:
    """Metrics over time of an env (requests, errors, latency, replicas, CPU, memory), a node or a proxy."""
    chosen = [name for name, value in (("--env", env), ("--node", node), ("--proxy", proxy)) if value]
    if len(chosen) != 1:
        raise fail("name exactly one of --env, --node or --proxy", 2)
    if replicas and not env:
        raise fail("--replicas: per-replica series are kept for an env only (use it with --env)", 2)
    try:
        window = HR.parse_since(since)
    except H.HistoryError as exc:
        raise fail(str(exc), 2) from None

    async def go() -> None:
        async with control() as c:
            if env:
                found = resolve_env(c.view, env)
                if found is None:
                    raise fail(f"--env: no environment {env!r} (use an id or project/app/env)")
                kind, ident, label = H.ENV, found.meta.id, env_path(c.view, found)
            elif node:
                nodes = [n for n in c.view.nodes() if node in (n.meta.id, n.name)]
                if not nodes:
                    raise fail(f"--node: no node {node!r} (use an id or name)")
                kind, ident, label = H.NODE, nodes[0].meta.id, nodes[0].name or nodes[0].meta.id
            else:
                kind, ident, label = H.PROXY, proxy, proxy
            series = await HR.history(c.conn.nc, kind, ident, window, time.time())
            if replicas and json:
                meta = {k: v for k, v in series.as_dict().items() if k not in ("series", "marks")}
                print(jsonlib.dumps({"name": label, **meta, **HR.replicas_as_dict(series)}, sort_keys=True))
                return
            if replicas:
                print("\n".join(replica_table(series, label, since)))
                return
            if json:
                print(jsonlib.dumps({"name": label, **series.as_dict()}, sort_keys=True))
                return
            print("\n".join(table(series, label, since)))

    run(go)
