"""Web console benchmark: the overview of 1,000 environments and the delay of a live update.

``python -m benchmarks.console_bench [--full]``. A real nats-server, the console in-process on a free port,
1,000 environments (each with a project, an app, an active release, a domain and its valid certificate;
3,000 full):

* overview server time: ``GET /`` rendered from the state view (20 loads quick, 50 full; target ≤ 300 ms);
  then again, by a console started afresh, with 2 hours of 5-min metric points recorded for every env (the
  cards' sparklines: one read of the history per 30 s, each env's line drawn once per read), in the browser too;
* time to first render in Debian's chromium driven by Playwright: the page's first contentful paint
  (10 loads quick, 20 full; target ≤ 300 ms), and when the whole page is parsed (DOMContentLoaded);
* live update delay: an environment's replica count is committed, and the time until the overview open in
  the browser shows it (SSE change → fetch → swap), p50/p99 (30 changes quick, 100 full; target p99 ≤ 500 ms).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, percentile, row
from benchmarks.console_rig import PASSWORD, USER, bench_console, bench_state, logged_in, seed_envs
from benchmarks.metrics_bench import metric_point
from shared import history as H
from shared.certs import VALID, pending_record
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer

CHROMIUM = Path("/usr/bin/chromium")


def _domain(i: int, env: pb.Environment, release: pb.Release) -> list[tuple[Message, str | None]]:
    """An env's image, domain and valid certificate (the overview shows them)."""
    release.image_ref = "demo/web@sha256:" + "a" * 64
    hostname = f"app{i:05d}.bench.example.com"
    domain = pb.Domain(project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id)
    domain.hostname = hostname
    domain.meta.id = f"01BENCHDOM{i:05d}"
    cert = pending_record(hostname, "local")
    cert.state, cert.chain_pem = VALID, "-----BEGIN CERTIFICATE-----"
    cert.not_after.FromSeconds(4_102_444_800)
    cert.renew_at.FromSeconds(4_102_444_800 - 86_400)
    return [(domain, None), (cert, None)]


async def _seed_sparklines(conn: Connection, env_ids: list[str], now: float) -> None:
    """Two hours of 5-min points for every env, as the recorder leaves them (what the overview's sparklines read)."""
    await H.ensure_streams(conn.js, 1)
    first = H.bucket_of(now, H.DOWN_SPAN) - 24 * H.DOWN_SPAN
    pending = []
    for env_id in env_ids:
        for i in range(24):
            pending.append(
                conn.js.publish(H.subject(H.DOWN, H.ENV, env_id), metric_point(first + i * H.DOWN_SPAN, H.DOWN_SPAN, i))
            )
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
    await asyncio.gather(*pending)


async def _server_times(url: str, loads: int) -> list[float]:
    async with logged_in(url) as http:
        times = []
        for _ in range(loads):
            started = time.perf_counter()
            async with http.get(f"{url}/") as page:
                await page.read()
            times.append((time.perf_counter() - started) * 1000)
        return times


async def _browser(
    url: str, view: StateView, writer: Writer, env_ids: list[str], loads: int, changes: int
) -> tuple[list[tuple[float, float]], list[float]]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = await browser.new_page()
        await page.goto(f"{url}/login")
        await page.get_by_label("User name").fill(USER)
        await page.get_by_label("Password").fill(PASSWORD)
        await page.get_by_role("button", name="Log in").click()
        await page.wait_for_selector("#overview")
        paints = []
        for _ in range(loads):
            await page.goto(f"{url}/")
            paint = await page.evaluate(
                "() => new Promise(done => { const seen = () => {"
                " const p = performance.getEntriesByName('first-contentful-paint');"
                " const n = performance.getEntriesByType('navigation')[0];"
                " if (p.length && n.domContentLoadedEventEnd) done([p[0].startTime, n.domContentLoadedEventEnd]);"
                " else setTimeout(seen, 10); }; seen(); })"
            )
            paints.append((float(paint[0]), float(paint[1])))
        await page.wait_for_timeout(300)  # the SSE stream attached
        delays = []
        for i in range(changes):
            env_id = env_ids[(i * 37) % len(env_ids)]
            env = pb.Environment()
            env.CopyFrom(view.env(env_id))  # type: ignore[arg-type]
            env.effective_replicas = 2 + i % 7
            shown = f"{env.effective_replicas} desired"
            started = time.perf_counter()
            await writer.commit(writer.txn().put(env))
            await page.wait_for_function(
                "([id, shown]) => { const cell = document.querySelector(`#env-${id} .replicas`);"
                " return cell !== null && cell.textContent.startsWith(shown); }",
                arg=[env_id, shown],
                polling="raf",
                timeout=10_000,
            )
            delays.append((time.perf_counter() - started) * 1000)
        await browser.close()
        return paints, delays


async def _bench(url: str, envs: int, loads: int, paints: int, changes: int, *, chromium: bool) -> list[Row]:
    async with bench_state(url) as bench:
        view, writer = bench.view, bench.writer
        env_ids = await seed_envs(writer, envs, lambda i: f"01BENCHENV{i:05d}", extra=_domain)
        async with bench_console(bench) as console:
            server = await _server_times(console.url, loads)
            rows = [
                row(f"console: overview of {envs:,} envs, server time (p50)", median(server), "ms", "≤ 300 ms"),
                row(f"console: overview of {envs:,} envs, server time (p99)", percentile(server, 99), "ms", "≤ 300 ms"),
            ]
            if chromium:
                first_paints, delays = await _browser(console.url, view, writer, env_ids, paints, changes)
        await _seed_sparklines(bench.conn, env_ids, time.time())
        async with bench_console(bench) as console:
            with_history = await _server_times(console.url, loads)
            if chromium:
                paints_with_history, _ = await _browser(console.url, view, writer, env_ids, paints, 0)
        rows += [
            row(
                f"console: overview of {envs:,} envs with 2 h of history each, server time (p50)",
                median(with_history),
                "ms",
                "≤ 300 ms",
                "every card's sparkline",
            ),
            row(
                f"console: overview of {envs:,} envs with 2 h of history each, server time (p99)",
                percentile(with_history, 99),
                "ms",
                "≤ 300 ms",
                "the first load reads and draws them",
            ),
        ]
        if not chromium:
            return rows
        return [
            *rows,
            row(
                f"console: overview of {envs:,} envs, first render in chromium (p50)",
                median([paint for paint, _ in first_paints]),
                "ms",
                "≤ 300 ms",
                "first contentful paint",
            ),
            row(
                f"console: overview of {envs:,} envs, page parsed in chromium (p50)",
                median([parsed for _, parsed in first_paints]),
                "ms",
                "",
                "DOMContentLoaded: every env in the DOM",
            ),
            row(
                f"console: overview of {envs:,} envs with 2 h of history each, first render in chromium (p50)",
                median([paint for paint, _ in paints_with_history]),
                "ms",
                "≤ 300 ms",
                "first contentful paint, every card with its sparkline",
            ),
            row(
                f"console: overview of {envs:,} envs with 2 h of history each, page parsed in chromium (p50)",
                median([parsed for _, parsed in paints_with_history]),
                "ms",
                "",
                "DOMContentLoaded",
            ),
            row("console: live update delay, commit → visible (p50)", median(delays), "ms", "", "SSE, fetch, swap"),
            row(
                "console: live update delay, commit → visible (p99)",
                percentile(delays, 99),
                "ms",
                "p99 ≤ 500 ms",
                "SSE, fetch, swap",
            ),
        ]


def run(quick: bool = True) -> list[Row]:
    envs, loads, paints, changes = (1_000, 20, 10, 30) if quick else (3_000, 50, 20, 100)
    with embedded_server("zattera-console-bench-") as server:
        return asyncio.run(_bench(server.url, envs, loads, paints, changes, chromium=CHROMIUM.exists()))


if __name__ == "__main__":
    bench_main("Console", run, __doc__, "3,000 envs, 50 loads, 20 paints, 100 changes")
