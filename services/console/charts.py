"""Charts of the metrics history, drawn on the server as SVG (docs/console.md, "Charts").

Why SVG from the server and not a vendored chart library: the page stays script-light (the CSP forbids
inline script anyway), works offline with nothing to vendor or update, a chart is a pure function of the
series (tested as text, no browser needed), it reaches assistive technology as a titled image with a
table-like summary, and a live update is the same region swap the rest of the console uses.

Each chart: a ``viewBox`` that scales to the width of its container, a y axis from 0 to a round maximum,
time labels in UTC, a polyline per series (broken where a value is unknown), and the env's marks (deploys,
scaling) as vertical lines with their text as a ``<title>`` tooltip. The data the test reads is in
attributes: ``data-mean``/``data-last``/``data-max`` per series, ``data-time`` per mark.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

from shared import history as H
from shared import history_read as HR

WIDTH = 560
HEIGHT = 210
LEFT = 46
RIGHT = 12
TOP = 12
BOTTOM = 26
"""The drawing's own units: the SVG scales uniformly to its container, so text of 14 units reads ~15 px in a
desktop column and ~9 px on a 390-px phone."""


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    values: Sequence[float | None]
    css: str
    """Class of the line (its colour and dash are the stylesheet's: ``.s-total``, ``.s-5xx`` …)."""


def nice_max(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 × 10^n at or above ``value`` (1 when nothing is above 0)."""
    if value <= 0 or math.isnan(value):
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        candidate = float(step * 10.0**exponent)
        if candidate >= value * 0.999999:
            return candidate
    return float(10.0 ** (exponent + 1))


def _num(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2g}"


def _time_label(t: float, window: int) -> str:
    fmt = "%H:%M" if window <= 2 * 86_400 else "%b %d"
    return time.strftime(fmt, time.gmtime(t))


def _stats(values: Sequence[float | None]) -> tuple[float, float, float]:
    known = [v for v in values if v is not None]
    if not known:
        return 0.0, 0.0, 0.0
    return sum(known) / len(known), known[-1], max(known)


def line_chart(
    chart_id: str,
    title: str,
    unit: str,
    start: int,
    span: int,
    series: Sequence[Series],
    marks: Sequence[H.Mark] = (),
    *,
    window: int = 3600,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> Markup:
    """One chart as an accessible ``<figure>`` holding an SVG (see the module docstring)."""
    slots = max((len(s.values) for s in series), default=0)
    end = start + slots * span
    plot_w = width - LEFT - RIGHT
    plot_h = height - TOP - BOTTOM
    top = nice_max(max((v for s in series for v in s.values if v is not None), default=0.0))

    def x(t: float) -> float:
        return LEFT + (t - start) / max(end - start, 1) * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - (v / top) * plot_h

    parts: list[str] = []
    title_id, desc_id = f"{chart_id}-t", f"{chart_id}-d"
    described = [(s.label, *_stats(s.values)) for s in series]
    summary = "; ".join(
        f"{label}: last {_num(last)}, average {_num(mean)}, peak {_num(peak)}" for label, mean, last, peak in described
    )
    parts.append(
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-labelledby="{title_id} {desc_id}" '
        f'data-start="{start}" data-span="{span}">'
        f'<title id="{title_id}">{escape(title)} ({escape(unit)})</title><desc id="{desc_id}">{escape(summary)}</desc>'
    )
    for i in range(4):  # grid and y labels: 0, ⅓, ⅔, max
        value = top * i / 3
        gy = y(value)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{width - RIGHT}" y1="{gy:.1f}" y2="{gy:.1f}"/>')
        parts.append(f'<text class="axis" x="{LEFT - 4}" y="{gy + 4:.1f}" text-anchor="end">{_num(value)}</text>')
    ticks = 4
    for i in range(ticks + 1):
        t = start + (end - start) * i / ticks
        anchor = "start" if i == 0 else ("end" if i == ticks else "middle")
        parts.append(
            f'<text class="axis" x="{x(t):.1f}" y="{height - 6}" text-anchor="{anchor}">{_time_label(t, window)}</text>'
        )
    for s in series:
        mean, last, peak = _stats(s.values)
        parts.append(
            f'<g class="series {s.css}" data-label="{escape(s.label)}" data-mean="{mean:.4g}" '
            f'data-last="{last:.4g}" data-max="{peak:.4g}">'
        )
        run: list[str] = []
        for index, known in enumerate(s.values):
            if known is None:
                if len(run) > 1:
                    parts.append(f'<polyline points="{" ".join(run)}"/>')
                run = []
                continue
            t = start + index * span + span / 2
            run.append(f"{x(t):.1f},{y(known):.1f}")
        if len(run) > 1:
            parts.append(f'<polyline points="{" ".join(run)}"/>')
        elif len(run) == 1:
            cx, cy = run[0].split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="2"/>')
        parts.append("</g>")
    for mark in marks:
        if not start <= mark.time <= end:
            continue
        mx = x(mark.time)
        kind = "deploy" if mark.kind.startswith("deploy.") else "scale"
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(mark.time))
        parts.append(
            f'<g class="mark mark-{kind}" data-time="{mark.time:.3f}" data-kind="{escape(mark.kind)}">'
            f"<title>{escape(when)} {escape(mark.kind)}: {escape(mark.text)}</title>"
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{TOP}" y2="{TOP + plot_h}"/>'
            f'<path d="M{mx - 5:.1f},{TOP - 2} L{mx + 5:.1f},{TOP - 2} L{mx:.1f},{TOP + 6} Z"/></g>'
        )
    parts.append("</svg>")
    legend = "".join(
        f'<li><span class="key {s.css}" aria-hidden="true"></span>{escape(s.label)} '
        f"<strong>{_num(_stats(s.values)[1])}</strong></li>"
        for s in series
    )
    return Markup(
        f'<figure class="chart" id="{chart_id}"><figcaption>{escape(title)} <small>{escape(unit)}</small></figcaption>'
        f'{"".join(parts)}<ul class="legend">{legend}</ul></figure>'
    )


ChartSpec = tuple[str, str, str, Sequence[Series]]
"""A chart of a history: (element id, title, unit, series)."""


def _charts(history: HR.History, window: int, specs: Sequence[ChartSpec], *, marks: bool = False) -> list[Markup]:
    """The charts of one history over its slots (with the env's marks when ``marks``)."""
    shown = history.marks if marks else ()
    return [
        line_chart(chart_id, title, unit, history.start, history.span, series, shown, window=window)
        for chart_id, title, unit, series in specs
    ]


MIB = 1_048_576
GIB = 1_073_741_824


def _scaled(values: Sequence[float | None], unit: int) -> list[float | None]:
    return [None if v is None else v / unit for v in values]


ENV_SERIES: dict[str, tuple[str, str, bool]] = {
    "all": ("rps", "s-total", False),
    "2xx": ("responses_2xx", "s-2xx", True),
    "4xx": ("responses_4xx", "s-4xx", True),
    "5xx": ("responses_5xx", "s-5xx", True),
    "p50": ("latency_p50_ms", "s-p50", False),
    "p95": ("latency_p95_ms", "s-p95", False),
    "p99": ("latency_p99_ms", "s-p99", False),
    "desired": ("desired", "s-desired", False),
    "running": ("running", "s-running", False),
    "in flight": ("inflight", "s-inflight", False),
    "cpu": ("cpu_percent", "s-cpu", False),
}
"""An env series by its label: (figure, line style, drawn per second: a count over the point's span)."""
ENV_CHARTS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("chart-requests", "Requests", "per second", ("all", "2xx", "4xx", "5xx")),
    ("chart-latency", "Latency", "ms", ("p50", "p95", "p99")),
    ("chart-replicas", "Replicas and requests in flight", "count", ("desired", "running", "in flight")),
    ("chart-cpu", "CPU", "% of a core, summed over replicas", ("cpu",)),
)
"""The env page's charts of :data:`ENV_SERIES` (memory, in MiB, and the per-replica charts follow)."""


def env_charts(history: HR.History, window: int) -> list[Markup]:
    """The env page's charts: requests and errors, latency, replicas and in-flight, CPU, memory (summed), then
    CPU and memory per replica."""
    specs: list[ChartSpec] = [
        (
            chart_id,
            title,
            unit,
            [
                Series(
                    label, history.values(ENV_SERIES[label][0], per_second=ENV_SERIES[label][2]), ENV_SERIES[label][1]
                )
                for label in labels
            ],
        )
        for chart_id, title, unit, labels in ENV_CHARTS
    ]
    memory = Series("memory", _scaled(history.values("memory_bytes"), MIB), "s-memory")
    specs.append(("chart-memory", "Memory", "MiB, summed over replicas", [memory]))
    return _charts(history, window, [*specs, *replica_specs(history)], marks=True)


REPLICA_STYLES = 8
"""Line styles ``.s-r0`` … ``.s-r7`` (colour and dash) in the stylesheet: at most this many replicas drawn."""


def replica_specs(history: HR.History) -> list[ChartSpec]:
    """CPU and memory per replica, one line each (labelled ``…id vN on node``), at most
    :data:`~shared.history_read.REPLICA_LINES` (those still running first); none when no replica reported."""
    every = HR.replica_series(history)
    if not every:
        return []
    shown, left_out = HR.pick_replicas(every, min(HR.REPLICA_LINES, REPLICA_STYLES))
    note = f"; {len(shown)} of {len(every)} replicas drawn, the latest" if left_out else ""
    return [
        (
            "chart-replica-cpu",
            "CPU per replica",
            f"% of a core{note}",
            [Series(r.label, r.cpu_percent, f"s-r{i}") for i, r in enumerate(shown)],
        ),
        (
            "chart-replica-memory",
            "Memory per replica",
            f"MiB{note}",
            [Series(r.label, _scaled(r.memory_bytes, MIB), f"s-r{i}") for i, r in enumerate(shown)],
        ),
    ]


def node_charts(history: HR.History, window: int) -> list[Markup]:
    """A node's charts: CPU, memory used and total, disk of the data dir, instances."""
    return _charts(
        history,
        window,
        [
            ("chart-node-cpu", "CPU", "% of the host", [Series("cpu", history.values("cpu_percent"), "s-cpu")]),
            (
                "chart-node-memory",
                "Memory",
                "GiB",
                [
                    Series("used", _scaled(history.values("memory_bytes"), GIB), "s-memory"),
                    Series("total", _scaled(history.values("memory_total_bytes"), GIB), "s-total"),
                ],
            ),
            (
                "chart-node-disk",
                "Disk of the data dir",
                "GiB",
                [
                    Series("used", _scaled(history.values("disk_used_bytes"), GIB), "s-memory"),
                    Series("total", _scaled(history.values("disk_total_bytes"), GIB), "s-total"),
                ],
            ),
            (
                "chart-node-instances",
                "Instances",
                "count",
                [Series("instances", history.values("instances"), "s-running")],
            ),
        ],
    )


def sparkline(requests: Sequence[float | None], errors: Sequence[float | None], label: str) -> Markup:
    """A small overview chart: requests (line) and 5xx (red line) over the same slots, scaled together."""
    width, height = 120, 28
    top = nice_max(max((v for v in [*requests, *errors] if v is not None), default=0.0))
    n = max(len(requests), 1)

    def points(values: Sequence[float | None]) -> str:
        return " ".join(
            f"{(i + 0.5) / n * width:.1f},{height - 2 - (v or 0.0) / top * (height - 4):.1f}"
            for i, v in enumerate(values)
        )

    mean_requests = _stats(requests)[0]
    mean_errors = _stats(errors)[0]
    text = f"{label}: {_num(mean_requests)} requests/s, {_num(mean_errors)} errors/s on average"
    return Markup(
        f'<svg class="spark" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(text)}" '
        f'data-requests="{mean_requests:.4g}" data-errors="{mean_errors:.4g}">'
        f'<polyline class="s-total" points="{points(requests)}"/>'
        f'<polyline class="s-5xx" points="{points(errors)}"/></svg>'
    )


WINDOWS = (("1h", 3600), ("24h", 86_400), ("7d", 7 * 86_400))


def window_of(text: str) -> tuple[str, int]:
    """The chart window a query names (1h by default; anything else is 1h too)."""
    for name, seconds in WINDOWS:
        if text == name:
            return name, seconds
    return WINDOWS[0]
