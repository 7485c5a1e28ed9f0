"""Metrics history on a real cluster, seen in Chromium (issue 40): a load generator sends a steady rate of
requests (some answered 500) through the proxy; the env's chart then shows that rate within 10 %, a 5xx
series, and a deploy mark at the deploy's time; the history survives a control-plane restart (the
services killed and started again); the env and node pages are screenshotted at desktop and phone widths
into ``.artifacts/console/``. Every wait is a condition on what the cluster recorded, never a sleep.

Run alone: ``python -m pytest tests/e2e/test_history.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared import history as H
from shared import history_read as HR
from shared.console_users import new_user, save_user, users_bucket
from tests.e2e.cluster import E2ECluster, app_source, env_by_name, healthy
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

CHROMIUM = Path("/usr/bin/chromium")
HAS_CHROMIUM = CHROMIUM.exists()
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "console"
PROD = "demo/hello/production"
PROD_HOST = "hello.localhost"
PASSWORD = "correct horse battery"
RATE_OK = 16.0
RATE_ERRORS = 4.0
LOAD_SECONDS = 42.0
"""Long enough for three whole 10-s slots inside the load, however it aligns with them (≥ 40 s)."""

ERROR_ROUTE = """
        if self.path.startswith("/error"):
            body = b"failing on purpose"
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
"""

async_api = pytest.importorskip("playwright.async_api")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(tmp_path_factory.mktemp("history"), trace=False)
    try:
        c.start()
        asyncio.run(c.wait_ready())
        yield c
    finally:
        c.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not HAS_CHROMIUM:
        pytest.fail("needs Debian's chromium (make system-packages)")
    async with async_api.async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


def failing_app(dest: Path) -> Path:
    """examples/hello, with ``/error`` answered 500."""
    source = app_source(dest, "v1")
    app = source / "app.py"
    text = app.read_text()
    app.write_text(
        text.replace('        if self.path == "/healthz":\n', ERROR_ROUTE + '        if self.path == "/healthz":\n', 1)
    )
    return source


@dataclass
class Generator:
    """``rate`` requests per second on a schedule for ``seconds`` (bounded), recording each send time."""

    port: int
    path: str
    rate: float
    seconds: float
    sent_at: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    async def run(self) -> None:
        interval = 1.0 / self.rate
        count = int(self.seconds * self.rate)
        tasks: list[asyncio.Task[None]] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            start = time.monotonic()
            for i in range(count):
                delay = start + i * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # the generator's own schedule, not a wait for the cluster
                tasks.append(asyncio.create_task(self._one(session)))
            await asyncio.gather(*tasks)

    async def _one(self, session: aiohttp.ClientSession) -> None:
        self.sent_at.append(time.time())
        try:
            async with session.get(f"http://127.0.0.1:{self.port}{self.path}", headers={"Host": PROD_HOST}) as r:
                await r.read()
                self.statuses.append(r.status)
        except (aiohttp.ClientError, OSError, TimeoutError):
            self.statuses.append(0)


def every(seconds: float, cond: Any) -> Any:
    """``cond`` asked at most once per ``seconds`` (each try is an HTTP round trip or a connection)."""

    async def paced() -> bool:
        result = await cond()
        if not result:
            await asyncio.sleep(seconds)  # pacing the polls of a condition, not a wait standing in for a timer
        return bool(result)

    return paced


async def api(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url, headers={"Accept": "application/json"}) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def log_in(http: aiohttp.ClientSession, base: str) -> None:
    async with http.get(f"{base}/login") as page:
        token = re.search(r'name="login_token" value="([^"]+)"', await page.text())
    assert token is not None
    form = {"username": "ada", "password": PASSWORD, "login_token": token.group(1)}
    async with http.post(f"{base}/login", data=form, allow_redirects=False) as done:
        assert done.status in (302, 303), await done.text()


def restart(cluster: E2ECluster, *names: str) -> None:
    """Kill control-plane services; the harness's supervisor starts them again (as ``zattera up`` would)."""
    for name in names:
        child = cluster.child(name)
        assert child.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)


async def test_env_chart_shows_the_generated_rate_errors_and_the_deploy(
    cluster: E2ECluster, tmp_path: Path, browser: Any
) -> None:
    assert cluster.up is not None
    base = f"http://127.0.0.1:{cluster.up.console_port}"
    source = failing_app(tmp_path / "app")
    await cluster.acli("apps", "apply", str(source / "zattera.toml"))
    deploy_started = time.time()
    await cluster.acli("deploy", str(source), "--env", PROD)
    deploy_ended = time.time()
    async with cluster.state() as (conn, view):
        await users_bucket(conn.js, create=True)
        await save_user(conn.js, new_user("ada", "admin", PASSWORD, rounds=4))
        env = env_by_name(view, "production")
        assert env is not None and healthy(view, env.meta.id)
        env_id = env.meta.id
        node_id = healthy(view, env_id)[0].node_id
        replica_ids = {H.replica_id(a.meta.id): a.node_id for a in healthy(view, env_id)}

    async def served() -> bool:
        return (await cluster.get(PROD_HOST))[0] == 200 and (await cluster.get(PROD_HOST, "/error"))[0] == 500

    await eventually(served, 30, "the app answers 200 and 500 through the proxy")
    ok = Generator(cluster.proxy_port, "/", RATE_OK, LOAD_SECONDS)
    errors = Generator(cluster.proxy_port, "/error", RATE_ERRORS, LOAD_SECONDS)
    await asyncio.gather(ok.run(), errors.run())
    assert ok.statuses.count(200) == len(ok.sent_at) and errors.statuses.count(500) == len(errors.sent_at)
    load_start = min(ok.sent_at[0], errors.sent_at[0])
    load_end = max(ok.sent_at[-1], errors.sent_at[-1])
    whole = [t for t in range(H.bucket_of(load_start, 10) + 10, H.bucket_of(load_end, 10), 10)]
    assert len(whole) >= 3

    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        await eventually(every(0.3, lambda: _console_up(http, base)), 30, "the console answers")
        await log_in(http, base)
        series: dict[str, Any] = {}

        async def recorded() -> bool:
            series.update(await api(http, f"{base}/api/env/{env_id}/metrics?window=1h"))
            slots = {series["start"] + i * series["span"]: i for i in range(len(series["series"]["rps"]))}
            return all(t in slots and series["series"]["rps"][slots[t]] for t in whole)

        await eventually(every(0.5, recorded), 40, "the history holds every whole 10-s slot of the load")
        slots = {series["start"] + i * series["span"]: i for i in range(len(series["series"]["rps"]))}
        sent_rate = (len(ok.sent_at) + len(errors.sent_at)) / (load_end - load_start)
        for t in whole:
            rate = series["series"]["rps"][slots[t]]
            assert abs(rate - sent_rate) <= 0.1 * sent_rate, (t, rate, sent_rate, series["series"]["rps"])
            errors_per_s = series["series"]["responses_5xx"][slots[t]] / 10
            assert abs(errors_per_s - RATE_ERRORS) <= 0.2 * RATE_ERRORS + 0.2, (t, errors_per_s)
        # Per replica: each replica's CPU and memory series, labelled by its node and release version.
        per_replica = {r["id"]: r for r in series["replicas"]}
        assert set(per_replica) == set(replica_ids), (per_replica.keys(), replica_ids)
        for rid, node in replica_ids.items():
            assert per_replica[rid]["node"] == node and per_replica[rid]["version"] >= 1, per_replica[rid]
            assert any(v for v in per_replica[rid]["memory_bytes"] if v is not None), per_replica[rid]
        marks = [m for m in series["marks"] if m["kind"].startswith("deploy.")]
        assert marks and any(deploy_started - 1 <= m["time"] <= deploy_ended + 15 for m in marks), marks

        # In Chromium: the chart, its 5xx series and the deploy mark, at desktop and phone widths.
        expect = async_api.expect
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        context = await browser.new_context(viewport={"width": 1400, "height": 1000})
        page = await context.new_page()
        await page.goto(f"{base}/login")
        await page.get_by_label("User name").fill("ada")
        await page.get_by_label("Password").fill(PASSWORD)
        await page.get_by_role("button", name="Log in").click()
        await page.goto(f"{base}/env/{env_id}")
        chart = page.locator("#chart-requests")
        await expect(chart).to_be_visible()
        peak = float(await chart.locator("g.series.s-total").get_attribute("data-max") or "0")
        assert abs(peak - sent_rate) <= 0.1 * sent_rate, (peak, sent_rate)
        assert float(await chart.locator("g.series.s-5xx").get_attribute("data-max") or "0") > 0
        assert await chart.locator("g.series.s-5xx polyline").count() >= 1
        drawn = [
            float(t or 0)
            for t in await chart.locator("g.mark-deploy").evaluate_all("ms => ms.map(m => m.dataset.time)")
        ]
        assert any(deploy_started - 1 <= t <= deploy_ended + 15 for t in drawn), drawn
        replica_lines = page.locator("#chart-replica-memory g.series")
        await expect(replica_lines).to_have_count(len(replica_ids))
        labels = await replica_lines.evaluate_all("gs => gs.map(g => g.dataset.label)")
        assert sorted(labels) == sorted(
            f"…{rid} v{per_replica[rid]['version']} on {n}" for rid, n in replica_ids.items()
        )
        assert await page.evaluate("document.documentElement.scrollWidth") <= 1400
        await page.screenshot(path=ARTIFACTS / "history-env-desktop.png", full_page=True)
        # Ids are short; Enter on one shows the whole id (keyboard).
        summary = page.locator("#deployments details.ident summary").first
        await summary.focus()
        await page.keyboard.press("Enter")
        await expect(page.locator("#deployments details.ident").first).to_have_attribute("open", "")
        # Keyboard: the window links are reachable and switch the chart.
        await page.get_by_role("link", name="24h").focus()
        await page.keyboard.press("Enter")
        await expect(page.locator("nav.windows a[aria-current='true']")).to_have_text("24h")
        await page.goto(f"{base}/")
        group = page.get_by_role("region", name=re.compile(r"^demo"))
        await expect(group.locator(f"#env-{env_id} svg.spark")).to_be_visible()
        await page.screenshot(path=ARTIFACTS / "history-overview-desktop.png", full_page=True)
        await page.goto(f"{base}/nodes/{node_id}")
        await expect(page.locator("#chart-node-cpu")).to_be_visible()
        await page.screenshot(path=ARTIFACTS / "history-node-desktop.png", full_page=True)
        phone = await browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True)
        phone_page = await phone.new_page()
        await phone_page.goto(f"{base}/login")
        await phone_page.get_by_label("User name").fill("ada")
        await phone_page.get_by_label("Password").fill(PASSWORD)
        await phone_page.get_by_role("button", name="Log in").click()
        await phone_page.goto(f"{base}/env/{env_id}")
        await expect(phone_page.locator("#chart-requests")).to_be_visible()
        assert await phone_page.evaluate("document.documentElement.scrollWidth") <= 390
        await phone_page.screenshot(path=ARTIFACTS / "history-env-phone.png", full_page=True)
        await phone_page.goto(f"{base}/nodes/{node_id}")
        assert await phone_page.evaluate("document.documentElement.scrollWidth") <= 390
        await phone_page.screenshot(path=ARTIFACTS / "history-node-phone.png", full_page=True)
        await context.close()
        await phone.close()

        # A control-plane restart: the history is kept, and the loop records again under its new leader.
        restart(cluster, "autoscale", "console")
        before = {t: series["series"]["rps"][slots[t]] for t in whole}
        resumed_after = time.time()
        await cluster.get(PROD_HOST)

        async def kept_and_resumed() -> bool:
            try:
                await log_in(http, base)
                again = await api(http, f"{base}/api/env/{env_id}/metrics?window=1h")
            except (aiohttp.ClientError, OSError, AssertionError):
                return False
            index = {again["start"] + i * again["span"]: i for i in range(len(again["series"]["rps"]))}
            kept = all(t in index and again["series"]["rps"][index[t]] == before[t] for t in whole)
            async with cluster.state() as (conn, _):
                fresh = await HR.read_points(conn.nc, H.RAW, H.NODE, node_id, resumed_after)
            return kept and bool(fresh)

        await eventually(every(1.0, kept_and_resumed), 60, "the history survived the restart and recording resumed")


async def _console_up(http: aiohttp.ClientSession, base: str) -> bool:
    try:
        async with http.get(f"{base}/login") as page:
            return page.status == 200
    except (aiohttp.ClientError, OSError):
        return False
