"""Certificates and jobs in the console, on a real NATS server: each env's hostnames with their certificate
state (worded as ``zattera domains list`` words it), live by env; cron entries' last runs and one-off runs,
and the cancel button's fenced write (``zattera jobs cancel``'s), refused to viewers and for ended jobs."""

from __future__ import annotations

import time

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.console import pages
from shared import certs as C
from shared import jobs as J
from shared import keys as K
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import ADMIN_USER, ENV_ID, VIEWER_USER, Running, seed
from tests.console.test_auth import client, csrf_of, log_in
from tests.console.test_streams import _messages, _next

VALID_UNTIL = 4_102_444_800  # 2100-01-01


def domain(hostname: str, env_id: str = ENV_ID) -> pb.Domain:
    record = pb.Domain(project_id="01PROJ", app_id="01APP", environment_id=env_id, hostname=hostname)
    record.meta.id = "01DOM" + hostname.split(".")[0].upper()
    return record


def certificate(hostname: str, state: int, error: str = "", chain: bool = False) -> pb.Certificate:
    cert = C.pending_record(hostname, "acme")
    cert.state, cert.last_error = state, error
    if chain:
        cert.chain_pem = "-----BEGIN CERTIFICATE-----"
        cert.not_after.FromSeconds(VALID_UNTIL)
        cert.renew_at.FromSeconds(VALID_UNTIL - 86400)
    return cert


async def seed_certificates(writer: Writer) -> None:
    txn = writer.txn().create(domain("shop.example.com")).create(domain("api.example.com"))
    txn.create(certificate("shop.example.com", C.VALID, chain=True))
    txn.create(certificate("api.example.com", C.FAILED, error="urn:ietf:params:acme:error:dns: NXDOMAIN"))
    txn.create(certificate("implicit.example.com", C.PENDING))
    await writer.commit(txn)


def job(job_id: str, status: int, cron_name: str = "", exit_code: int | None = None) -> pb.Job:
    record = pb.Job(
        project_id="01PROJ", app_id="01APP", environment_id=ENV_ID, cron_name=cron_name, status=status, attempt=1
    )
    record.meta.id = job_id
    record.command = "python manage.py clearsessions" if cron_name else "python manage.py migrate"
    record.slot_at.FromSeconds(1_780_000_000 + len(job_id))
    if status != J.PENDING:
        record.started_at.FromSeconds(1_780_000_100)
    if exit_code is not None:
        record.finished_at.FromSeconds(1_780_000_112)
        record.exit_code, record.exit_code_known = exit_code, True
    return record


async def seed_jobs(writer: Writer, view: StateView) -> None:
    env = pb.Environment()
    env.CopyFrom(view.env(ENV_ID))  # type: ignore[arg-type]
    env.service.cron.add(name="nightly", schedule="0 3 * * *", command="python manage.py clearsessions")
    txn = writer.txn().put(env)
    txn.create(job("01JOBCRON1", J.FAILED, cron_name="nightly", exit_code=3))
    txn.create(job("01JOBRUN", J.RUNNING))
    txn.create(job("01JOBDONE", J.SUCCEEDED, exit_code=0))
    await writer.commit(txn)


async def test_each_env_shows_its_hostnames_certificate_state_as_domains_list_words_it(
    view: StateView, writer: Writer
) -> None:
    await seed(writer)
    await seed_certificates(writer)
    routes = cpb.RouteSnapshot(version=1)
    routes.http_routes.add(hostname="implicit.example.com", path_prefix="/", environment_id=ENV_ID)
    [row] = pages.overview(view, routes)
    assert row["certificates"] == [
        {"hostname": "api.example.com", "state": "failed", "text": "failed: urn:ietf:params:acme:error:dns: NXDOMAIN"},
        {"hostname": "implicit.example.com", "state": "pending", "text": "pending"},
        {"hostname": "shop.example.com", "state": "valid", "text": "valid until 2100-01-01 00:00:00 UTC"},
    ]
    renewing = certificate("shop.example.com", C.RENEWING, error="rateLimited", chain=True)
    [shop] = [r for r in C.domain_rows(view, time.time(), str) if r.hostname == "shop.example.com"]
    assert C.certificate_text(C.domain_row("shop.example.com", "", renewing, time.time())) == (
        "renewing (valid until 2100-01-01 00:00:00 UTC; last try: rateLimited)"
    )
    assert shop.environment_id == ENV_ID and shop.environment == ENV_ID
    # A certificate's change is its hostname's env's: its Domain's, else the routes'; of no env, none's.
    cert_id = K.cert_id("implicit.example.com")
    assert pages.changed_envs(view, [(K.CERT, K.cert_id("api.example.com"))]) == [ENV_ID]
    assert pages.changed_envs(view, [(K.CERT, cert_id)], pages.routed_envs(routes)) == [ENV_ID]
    assert pages.changed_envs(view, [(K.CERT, cert_id)]) == []


async def test_the_overview_shows_certificates_and_hears_of_their_changes_by_env(
    console: Running, view: StateView, writer: Writer
) -> None:
    await seed_certificates(writer)
    async with client() as http:
        await log_in(http, console.url, VIEWER_USER)
        async with http.get(f"{console.url}/") as page:
            text = await page.text()
        assert "valid until 2100-01-01 00:00:00 UTC" in text and "failed: urn:ietf:params:acme:error:dns" in text
        async with http.get(f"{console.url}/live?page=overview") as stream:
            messages = _messages(stream)
            await _next(messages, "hello")
            renewed = certificate("api.example.com", C.VALID, chain=True)
            await writer.commit(writer.txn().put(renewed))
            assert await _next(messages, "change") == {"envs": [ENV_ID]}
        async with http.get(f"{console.url}/?only={ENV_ID}") as row:
            assert "failed:" not in await row.text()


async def test_the_env_page_shows_cron_and_one_off_runs_and_cancels_a_running_job(
    console: Running, view: StateView, writer: Writer
) -> None:
    await seed_jobs(writer, view)
    cancel = f"{console.url}/env/{ENV_ID}/jobs/01JOBRUN/cancel"
    async with client() as viewer:
        await log_in(viewer, console.url, VIEWER_USER)
        async with viewer.get(f"{console.url}/env/{ENV_ID}") as page:
            text = await page.text()
        assert "nightly" in text and "12.0s" in text and "/jobs/01JOBRUN/cancel" not in text  # no button to viewers
        headers = {"X-CSRF-Token": await csrf_of(viewer, console.url), "Accept": "application/json"}
        async with viewer.post(cancel, headers=headers) as refused:
            assert refused.status == 403
    async with client() as admin:
        await log_in(admin, console.url, ADMIN_USER)
        async with admin.get(f"{console.url}/api/env/{ENV_ID}") as api:
            jobs = (await api.json())["jobs"]
        [nightly] = jobs["cron"]
        assert (nightly["name"], nightly["schedule"]) == ("nightly", "0 3 * * *")
        assert [(r["id"], r["status"], r["exit_code"], r["duration"]) for r in nightly["runs"]] == [
            ("01JOBCRON1", "failed", "3", "12.0s")
        ]
        assert [(r["id"], r["status"], r["can_cancel"]) for r in jobs["one_off"]] == [
            ("01JOBDONE", "succeeded", False),
            ("01JOBRUN", "running", True),
        ]
        async with admin.get(f"{console.url}/env/{ENV_ID}") as page:
            assert "/jobs/01JOBRUN/cancel" in await page.text()
        headers = {"X-CSRF-Token": await csrf_of(admin, console.url), "Accept": "application/json"}
        async with admin.post(cancel) as no_csrf:
            assert no_csrf.status == 403
        async with admin.get(f"{console.url}/live?page=env&env={ENV_ID}") as stream:
            messages = _messages(stream)
            await _next(messages, "hello")
            async with admin.post(cancel, headers=headers) as done:
                assert done.status == 200 and (await done.json())["ok"]
            assert await _next(messages, "change") == {"envs": [ENV_ID]}
        canceled = view.get(K.JOB, "01JOBRUN")
        assert isinstance(canceled, pb.Job) and canceled.cancel_requested
        assert canceled.message == f"canceled by console:{ADMIN_USER}"
        async with admin.post(f"{console.url}/env/{ENV_ID}/jobs/01JOBDONE/cancel", headers=headers) as ended:
            assert ended.status == 409 and await ended.json() == {"error": "job 01JOBDONE already ended (succeeded)"}
        async with admin.post(f"{console.url}/env/01OTHER/jobs/01JOBRUN/cancel", headers=headers) as elsewhere:
            assert elsewhere.status == 409 and "not found in env 01OTHER" in (await elsewhere.json())["error"]
