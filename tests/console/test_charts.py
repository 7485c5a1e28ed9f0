"""Charts of the metrics history in the console: the SVG drawing (pure), then the env page, its chart
fragment and JSON, the node page and the overview's sparklines over real HTTP and real NATS."""

from __future__ import annotations

import re
import time

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.console import charts
from shared import history as H
from shared import history_read as HR
from shared.connection import Connection
from tests.console.rig import ADMIN_USER, ENV_ID, Running
from tests.console.test_auth import client, log_in


def test_a_chart_breaks_its_line_at_unknown_values_and_draws_marks_at_their_time() -> None:
    marks = [H.Mark(1_000_000 + 300.0, "deploy.succeeded", "release <v2> is live")]
    svg = str(
        charts.line_chart(
            "c",
            "Requests",
            "per second",
            1_000_000,
            60,
            [charts.Series("all", [1.0, 2.0, None, 4.0, 5.0, 6.0], "s-total")],
            marks,
        )
    )
    assert svg.count("<polyline") == 2  # broken at the gap
    assert 'data-mean="3.6"' in svg and 'data-last="6"' in svg and 'data-max="6"' in svg
    mark = re.search(r'<g class="mark mark-deploy" data-time="1000300.000".*?<line x1="([\d.]+)"', svg)
    assert mark is not None
    assert abs(float(mark.group(1)) - (charts.LEFT + 300 / 360 * (charts.WIDTH - charts.LEFT - charts.RIGHT))) < 0.2
    assert "release &lt;v2&gt; is live" in svg and "<v2>" not in svg
    assert 'role="img"' in svg and '<title id="c-t">Requests (per second)</title>' in svg


def test_nice_max() -> None:
    assert [charts.nice_max(v) for v in (0, 0.7, 3, 19, 240, 1001)] == [1, 1, 5, 20, 250, 2000]


async def seed_history(conn: Connection) -> float:
    await H.ensure_streams(conn.js, 1)
    now = time.time()
    start = H.bucket_of(now - 3700, 10)
    for i in range(372):
        t = start + 10 * i
        point = cpb.MetricPoint(time=t, span=10, rps=40.0, responses_2xx=380, responses_5xx=20, desired=2, running=2)
        await conn.js.publish(H.subject(H.RAW, H.ENV, ENV_ID), point.SerializeToString())
        node_point = cpb.MetricPoint(
            time=t, span=10, cpu_percent=30.0, memory_bytes=1 << 30, memory_total_bytes=4 << 30
        )
        await conn.js.publish(H.subject(H.RAW, H.NODE, "n1"), node_point.SerializeToString())
    # 25 five-minute points, the current bucket's included: the overview's 2 h still hold 24 of them when a
    # 5-min boundary passes between this seed and the page's read (the slot before would read as idle).
    for b in range(25):
        down = cpb.MetricPoint(time=H.bucket_of(now, 300) - 300 * b, span=300, rps=40.0, responses_5xx=6000)
        await conn.js.publish(H.subject(H.DOWN, H.ENV, ENV_ID), down.SerializeToString())
    deployed = float(start + 1500)
    await conn.js.publish(H.mark_subject(ENV_ID), H.mark_of(deployed, "deploy.succeeded", "release v2 is live"))
    return deployed


async def test_env_node_and_overview_pages_show_the_history(console: Running, conn: Connection) -> None:
    deployed = await seed_history(conn)
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        async with http.get(f"{console.url}/env/{ENV_ID}") as page:
            html = await page.text()
        assert page.status == 200
        requests = re.search(r'<g class="series s-total" data-label="all" data-mean="([\d.]+)"', html)
        assert requests is not None and abs(float(requests.group(1)) - 40.0) < 0.5
        errors = re.search(r'<g class="series s-5xx" data-label="5xx" data-mean="([\d.]+)"', html)
        assert errors is not None and abs(float(errors.group(1)) - 2.0) < 0.1
        assert f'data-time="{deployed:.3f}"' in html
        assert 'aria-current="true">1h<' in html
        async with http.get(f"{console.url}/env/{ENV_ID}/charts?window=24h") as fragment:
            text = await fragment.text()
        assert "<html" not in text and 'data-span="300"' in text and 'aria-current="true">24h<' in text
        async with http.get(f"{console.url}/api/env/{ENV_ID}/metrics?window=1h") as api:
            body = await api.json()
        assert body["span"] == 10 and max(v for v in body["series"]["rps"] if v) == 40.0
        assert body["marks"][0]["kind"] == "deploy.succeeded"
        async with http.get(f"{console.url}/api/env/{ENV_ID}/metrics?window=2w") as bad:
            assert bad.status == 400 and (await bad.json())["error"] == "window '2w': expected one of 1h, 24h, 7d"
        async with http.get(f"{console.url}/env/{ENV_ID}?window=2w") as bad_page:
            assert (
                bad_page.status == 400 and "window &#39;2w&#39;: expected one of 1h, 24h, 7d" in await bad_page.text()
            )
        async with http.get(f"{console.url}/nodes/n1") as node_page:
            node_html = await node_page.text()
        assert node_page.status == 200 and "node-one" in node_html and 'id="chart-node-cpu"' in node_html
        async with http.get(f"{console.url}/nodes/nope") as missing:
            assert missing.status == 404
        async with http.get(f"{console.url}/") as overview:
            over = await overview.text()
        spark = re.search(r'<svg class="spark"[^>]*data-requests="([\d.]+)"', over)
        assert spark is not None and abs(float(spark.group(1)) - 40.0) < 0.5


async def seed_replicas(conn: Connection) -> None:
    """An hour of the env's 10-s points with three replicas: two on n1 throughout, one on n2 that stopped; the
    first labelled at each 5-min bucket's start only (as the recorder writes them)."""
    await H.ensure_streams(conn.js, 1)
    start = H.bucket_of(time.time() - 3700, 10)
    for i in range(372):
        point = cpb.MetricPoint(time=start + 10 * i, span=10, running=3, cpu_percent=70.0, memory_bytes=600 << 20)
        point.replicas.add(
            id="AAAAAAA1", cpu_percent=20.0, memory_bytes=100 << 20, node="n1" if (start + 10 * i) % 300 == 0 else ""
        )
        point.replicas.add(id="BBBBBBB2", cpu_percent=30.0, memory_bytes=200 << 20, node="n1", version=2)
        if i < 200:
            point.replicas.add(id="CCCCCCC3", cpu_percent=20.0, memory_bytes=300 << 20, node="n2", version=1)
        await conn.js.publish(H.subject(H.RAW, H.ENV, ENV_ID), point.SerializeToString())


async def test_the_env_page_draws_one_line_per_replica(console: Running, conn: Connection) -> None:
    await seed_replicas(conn)
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        async with http.get(f"{console.url}/env/{ENV_ID}") as page:
            html = await page.text()
        assert page.status == 200
        for chart_id in ("chart-replica-cpu", "chart-replica-memory"):
            figure = re.search(rf'<figure class="chart" id="{chart_id}">.*?</figure>', html, re.S)
            assert figure is not None
            lines = re.findall(r'<g class="series (s-r\d)" data-label="([^"]+)"', figure.group(0))
            assert lines == [
                ("s-r0", "…AAAAAAA1 on n1"),
                ("s-r1", "…BBBBBBB2 v2 on n1"),
                ("s-r2", "…CCCCCCC3 v1 on n2"),
            ]
        cpu = re.search(r'data-label="…BBBBBBB2 v2 on n1" data-mean="([\d.]+)"', html)
        assert cpu is not None and float(cpu.group(1)) == 30.0
        memory = re.search(
            r'id="chart-replica-memory".*?data-label="…CCCCCCC3 v1 on n2" data-mean="([\d.]+)"', html, re.S
        )
        assert memory is not None and float(memory.group(1)) == 300.0
        async with http.get(f"{console.url}/api/env/{ENV_ID}/metrics?window=1h") as api:
            body = await api.json()
        stopped = next(r for r in body["replicas"] if r["id"] == "CCCCCCC3")
        assert stopped["node"] == "n2" and stopped["memory_bytes"][-1] is None  # its series ended
        assert max(v for v in stopped["memory_bytes"] if v is not None) == 300 << 20


def test_replica_lines_are_capped_and_the_caption_says_so() -> None:
    slots: list[tuple[int, cpb.MetricPoint | None]] = []
    for i in range(3):
        point = cpb.MetricPoint(time=1_000_000 + 10 * i, span=10)
        for r in range(11):
            point.replicas.add(id=f"R{r:07d}", cpu_percent=float(r), memory_bytes=1 << 20)
        slots.append((point.time, point))
    history = HR.History(H.ENV, "e", 1_000_000, 1_000_030, 10, slots, [])
    cpu_chart = str(charts.env_charts(history, 3600)[-2])
    assert cpu_chart.count('<g class="series s-r') == 8
    assert "8 of 11 replicas drawn" in cpu_chart and "…R0000010" in cpu_chart and "…R0000002" not in cpu_chart

