"""The console's part of a canary (issue 41): the env page shows the running canary's step, weights and
live figures, and its Promote/Abort buttons record the request through the same action as the CLI."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.console import pages
from shared.clock import to_timestamp
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import ADMIN_USER, ENV_ID, Running, seed
from tests.console.test_auth import client, csrf_of, log_in


def canary() -> pb.Deployment:
    d = pb.Deployment(
        environment_id=ENV_ID,
        project_id="01PROJ",
        app_id="01APP",
        release_id="01REL2",
        previous_release_id="01REL1",
        phase=pb.DEPLOYMENT_PHASE_CANARY,
    )
    d.meta.id = "01DEPCANARY"
    d.canary.step, d.canary.weight = 1, 25
    return d


async def with_canary(writer: Writer, view: StateView, *, seeded: bool = False) -> None:
    if not seeded:
        await seed(writer)
    release = pb.Release()
    found = view.release("01REL2")
    assert found is not None
    release.CopyFrom(found)
    release.service.canary.steps.extend([5, 25, 50, 100])
    release.service.canary.min_requests = 100
    release.service.canary.max_error_ratio = 0.01
    await writer.commit(writer.txn().put(release).create(canary()))


async def test_the_env_page_shows_the_canary_against_its_bounds(view: StateView, writer: Writer) -> None:
    await with_canary(writer, view)
    traffic = cpb.ReleaseTraffic(
        environment_id=ENV_ID, release_id="01REL2", step_tag="01DEPCANARY.1", requests=40, errors_5xx=1
    )
    heartbeat = cpb.ProxyHeartbeat(time=to_timestamp(0), proxy_id="p1", release_traffic=[traffic])
    shown = pages.env_canary(view, ENV_ID, [heartbeat])
    assert shown["deployment_id"] == "01DEPCANARY"
    assert shown["line"].startswith("canary step 2/4: new 25% / stable 75%; requests 40/100, 5xx 2.50% (max 1.00%)")
    assert pages.env_canary(view, "01OTHER", [heartbeat]) == {}


async def test_promote_from_the_console_records_the_users_request(
    console: Running, view: StateView, writer: Writer
) -> None:
    await with_canary(writer, view, seeded=True)  # the console fixture seeded the env
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        async with http.get(f"{console.url}/env/{ENV_ID}") as page:
            text = await page.text()
            assert page.status == 200 and "canary step 2/4" in text and "Promote canary" in text, text[-3000:]
        csrf = await csrf_of(http, console.url)
        headers = {"X-CSRF-Token": csrf, "Accept": "application/json"}
        url = f"{console.url}/env/{ENV_ID}/deployments/01DEPCANARY/promote"
        async with http.post(url, data={}, headers=headers) as done:
            assert done.status == 200, await done.text()
        d = view.deployment("01DEPCANARY")
        assert d is not None and (d.canary.requested, d.canary.requested_by) == ("promote", f"console:{ADMIN_USER}")
        async with http.post(url.replace("promote", "abort"), data={}, headers=headers) as refused:
            assert refused.status == 409 and "promote already requested" in await refused.text()
