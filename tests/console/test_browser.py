"""The console in a real browser: Playwright driving Debian's chromium against a console on real NATS.

One browser for the whole scenario (CI time); screenshots of the main pages go to ``.artifacts/console/``
(ignored by git) so a failing run can be looked at.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.applogs import LogLimits, app_log_subject, app_logs_stream_config
from shared.natsio import Connection
from shared.txn import Writer
from shared.view import StateView
from tests.console.rig import ADMIN_USER, ENV_ID, PASSWORD, VIEWER_USER, add_users, random_secret, running_console, seed
from tests.waiting import eventually

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "console"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (make system-packages)")

async_api = pytest.importorskip("playwright.async_api")


@pytest.fixture
async def browser() -> AsyncIterator[object]:
    async with async_api.async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


async def _log_line(conn: Connection, text: str) -> None:
    batch = cpb.InstanceLogBatch(environment_id=ENV_ID, instance_id="01INSTANCEAAAA", node_id="n1", release_id="01REL1")
    line = batch.lines.add(line=text, stream="stdout")
    line.time.FromNanoseconds(time.time_ns())
    await conn.js.publish(app_log_subject(ENV_ID, "01INSTANCEAAAA"), batch.SerializeToString())


async def _log_in(page: object, url: str, user: str) -> None:
    await page.goto(f"{url}/login")  # type: ignore[attr-defined]
    await page.get_by_label("User name").fill(user)  # type: ignore[attr-defined]
    await page.get_by_label("Password").fill(PASSWORD)  # type: ignore[attr-defined]
    await page.get_by_role("button", name="Log in").click()  # type: ignore[attr-defined]


async def _set_phase(view: StateView, writer: Writer, phase: int, *, activate: str = "") -> None:
    (deployment,) = view.deployments(ENV_ID)
    moved = pb.Deployment()
    moved.CopyFrom(deployment)
    moved.phase = phase  # type: ignore[assignment]
    txn = writer.txn().put(moved)
    if activate:
        env = pb.Environment()
        env.CopyFrom(view.env(ENV_ID))  # type: ignore[arg-type]
        env.active_release_id = activate
        txn.put(env)
    await writer.commit(txn)


async def test_operator_rolls_back_watches_it_live_tails_logs_and_sets_a_secret(
    conn: Connection, view: StateView, writer: Writer, browser: object
) -> None:
    expect = async_api.expect
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await seed(writer)
    await add_users(conn)
    await conn.js.add_stream(app_logs_stream_config(ENV_ID, LogLimits(1 << 20, 3600.0), replicas=1))
    async with running_console(conn, view, writer) as console:
        context = await browser.new_context()  # type: ignore[attr-defined]
        page = await context.new_page()
        page.on("dialog", lambda dialog: dialog.accept())
        await _log_in(page, console.url, ADMIN_USER)

        row = page.get_by_role("listitem").filter(has_text="shop/web/production")
        await expect(row).to_contain_text("v2")
        await expect(row).to_contain_text("2 desired / 0 running / 0 healthy")
        await page.screenshot(path=ARTIFACTS / "overview.png", full_page=True)

        await row.get_by_role("link").click()
        await expect(page.get_by_role("heading", level=1)).to_have_text("shop/web/production")
        await page.get_by_role("button", name="Roll back to v1").click()
        await expect(page.get_by_role("status")).to_contain_text("rolling back to v1")
        deployments = page.locator("#deployments")
        await expect(deployments).to_contain_text("pending")

        # The orchestrator's progress shows without a reload.
        await _set_phase(view, writer, pb.DEPLOYMENT_PHASE_HEALTHCHECKING)
        await expect(deployments).to_contain_text("healthchecking")
        await _set_phase(view, writer, pb.DEPLOYMENT_PHASE_SUCCEEDED, activate="01REL1")
        await expect(deployments).to_contain_text("succeeded")
        await expect(page.locator("#env-summary")).to_contain_text("Active v1")

        log = page.locator("#log")
        await _log_line(conn, "tail attached")
        await expect(log).to_contain_text("tail attached", timeout=10_000)
        await _log_line(conn, "GET /checkout 200")
        await expect(log).to_contain_text("GET /checkout 200", timeout=1_000)
        await page.screenshot(path=ARTIFACTS / "env.png", full_page=True)

        value = random_secret()
        await page.get_by_label("Name", exact=True).fill("API_TOKEN")
        await page.get_by_label("Value").fill(value)
        await page.get_by_role("button", name="Set secret").click()
        await expect(page.get_by_role("status")).to_contain_text("secret API_TOKEN set")
        await expect(page.locator("#secrets")).to_contain_text("API_TOKEN v1")
        assert value not in await page.content()
        await eventually(lambda: any(s.name == "API_TOKEN" for s in view.all(K.SECRET)), what="the sealed secret")

        for name in ("nodes", "builds", "volumes", "events"):
            await page.goto(f"{console.url}/{name}")
            await page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)

        # A plain POST without the form's CSRF token is refused, even with the session cookie.
        refused = await page.request.post(f"{console.url}/nodes/n1/cordon", form={"x": "1"})
        assert refused.status == 403 and "CSRF" in await refused.text()
        await context.close()

        # A viewer, on a phone-sized screen, sees the pages and is refused on an action.
        phone = await browser.new_context(viewport={"width": 390, "height": 844})  # type: ignore[attr-defined]
        page = await phone.new_page()
        page.on("dialog", lambda dialog: dialog.accept())
        await _log_in(page, console.url, VIEWER_USER)
        await page.screenshot(path=ARTIFACTS / "overview-phone.png", full_page=True)
        await page.goto(f"{console.url}/nodes")
        await page.get_by_role("button", name="Cordon node-one").click()
        await expect(page.get_by_role("alert")).to_contain_text("viewer role, which cannot act")
        await phone.close()
    node = view.node("n1")
    assert node is not None and node.schedulable
