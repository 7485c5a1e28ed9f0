"""The console in a real browser: Playwright driving Debian's chromium against a console on real NATS.

One browser for the whole scenario (CI time); screenshots of the main pages go to ``.artifacts/console/``
(ignored by git) so a failing run can be looked at.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import certs as C
from shared import keys as K
from shared.applogs import LogLimits, app_log_subject, app_logs_stream_config
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import ADMIN_USER, PASSWORD, VIEWER_USER, add_users, cluster_key, random_secret, running_console
from tests.console.test_certs_jobs import certificate, domain
from tests.orchestrator.rig import Rig, make_rig, seed_deploy_rig
from tests.waiting import eventually

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "console"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (make system-packages)")

async_api = pytest.importorskip("playwright.async_api")


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with async_api.async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def rig(conn: Connection) -> AsyncIterator[Rig]:
    """The reference deploy rig (orchestrator with its lease, n1 and n2, rel1 running on both, dep1 rel1 → rel2
    pending), named shop/web, with the cluster secrets key published."""
    async with make_rig(conn) as made:
        await seed_deploy_rig(made)
        project = pb.Project(name="shop")
        project.meta.id = "p1"
        app = pb.App(project_id="p1", name="web")
        app.meta.id = "a1"
        await made.put(project, app, cluster_key())
        await made.observe(made.blue(), pb.INSTANCE_STATE_HEALTHY)
        yield made


async def _log_line(conn: Connection, env_id: str, text: str) -> None:
    batch = cpb.InstanceLogBatch(environment_id=env_id, instance_id="blue-0", node_id="n1", release_id="rel1")
    line = batch.lines.add(line=text, stream="stdout")
    line.time.FromNanoseconds(time.time_ns())
    await conn.js.publish(app_log_subject(env_id, "blue-0"), batch.SerializeToString())


async def _log_in(page: Any, url: str, user: str) -> None:
    await page.goto(f"{url}/login")
    await page.get_by_label("User name").fill(user)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Log in").click()


async def test_operator_watches_a_deploy_rolls_back_tails_logs_and_sets_a_secret(
    conn: Connection, view: StateView, writer: Writer, rig: Rig, browser: Any
) -> None:
    expect = async_api.expect
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await add_users(conn)
    await conn.js.add_stream(app_logs_stream_config(rig.env_id, LogLimits(1 << 20, 3600.0), replicas=1))
    await view.wait_fresh()
    async with running_console(conn, view, writer) as console:
        context = await browser.new_context()
        page = await context.new_page()
        page.on("dialog", lambda dialog: dialog.accept())
        await _log_in(page, console.url, ADMIN_USER)

        card = page.get_by_role("listitem").filter(has_text="shop/web/env-d")
        await expect(card).to_contain_text("v1")
        await expect(card).to_contain_text("2 desired / 2 running / 2 healthy")
        # A certificate obtained for the env's domain shows on its card without a reload.
        await writer.commit(
            writer.txn()
            .create(domain("shop.example.com", rig.env_id))
            .create(certificate("shop.example.com", C.VALID, chain=True))
        )
        await expect(card).to_contain_text("shop.example.com valid until 2100-01-01 00:00:00 UTC")
        await page.screenshot(path=ARTIFACTS / "overview.png", full_page=True)

        # The orchestrator walks dep1 through its phases; each one shows without a reload.
        await card.get_by_role("link").click()
        await expect(page.get_by_role("heading", level=1)).to_have_text("shop/web/env-d")
        deployments = page.locator("#deployments")
        await expect(deployments).to_contain_text("pending")
        for phase, report in (
            ("placing", None),
            ("starting", None),
            ("healthchecking", pb.INSTANCE_STATE_RUNNING),
            ("promoting", pb.INSTANCE_STATE_HEALTHY),
            ("draining_old", None),
        ):
            if report is not None:
                await rig.observe(rig.green(), report)
            await rig.step()
            await expect(deployments.locator("tr", has_text="dep1")).to_contain_text(phase)
            if phase == "healthchecking":
                await expect(deployments.get_by_role("progressbar", name="step 6 of 9")).to_be_visible()
        await expect(page.locator("#env-summary")).to_contain_text("Active v2")

        await page.get_by_role("button", name="Roll back to v1").click()
        await expect(page.get_by_role("status")).to_contain_text("rolling back to v1")
        rollback = next(d for d in view.deployments(rig.env_id) if d.is_rollback)
        await eventually(lambda: rig.view.deployment(rollback.meta.id) is not None, what="the rollback in the rig")
        await rig.step(rollback.meta.id)
        await expect(deployments.locator("tr", has_text=rollback.meta.id)).to_contain_text("promoting")
        await rig.step(rollback.meta.id)
        await expect(page.locator("#env-summary")).to_contain_text("Active v1")

        log = page.locator("#log")
        await _log_line(conn, rig.env_id, "tail attached")
        await expect(log).to_contain_text("tail attached", timeout=10_000)
        await _log_line(conn, rig.env_id, "GET /checkout 200")
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
        phone = await browser.new_context(viewport={"width": 390, "height": 844})
        page = await phone.new_page()
        page.on("dialog", lambda dialog: dialog.accept())
        await _log_in(page, console.url, VIEWER_USER)
        await page.screenshot(path=ARTIFACTS / "overview-phone.png", full_page=True)
        await page.goto(f"{console.url}/nodes")
        await page.get_by_role("button", name="Cordon n1").click()
        await expect(page.get_by_role("alert")).to_contain_text("viewer role, which cannot act")
        await phone.close()
    node = view.node("n1")
    assert node is not None and node.schedulable
