"""Console auth over real HTTP against a real NATS server: sessions, CSRF, roles, rate limiting, secrets."""

from __future__ import annotations

import re
import ssl
from pathlib import Path

import aiohttp
from zattera.v1 import types_pb2 as pb

from services.console.settings import server_ssl_context
from shared import keys as K
from shared.backup.status import SCHEDULE_ID
from shared.connection import Connection
from shared.console_users import remove_user
from shared.security.tls import generate
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import (
    ADMIN_USER,
    ENV_ID,
    LOGIN_FAILURES,
    PASSWORD,
    VIEWER_USER,
    Running,
    add_users,
    random_secret,
    running_console,
)
from tests.waiting import eventually


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def log_in(http: aiohttp.ClientSession, url: str, user: str, password: str = PASSWORD) -> aiohttp.ClientResponse:
    async with http.get(f"{url}/login") as page:
        token = re.search(r'name="login_token" value="([^"]+)"', await page.text())
    assert token is not None
    form = {"username": user, "password": password, "login_token": token.group(1)}
    return await http.post(f"{url}/login", data=form, allow_redirects=False)


async def csrf_of(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/") as page:
        found = re.search(r'name="csrf-token" content="([^"]+)"', await page.text())
    assert found is not None
    return found.group(1)


async def test_pages_need_a_session(console: Running) -> None:
    async with client() as http:
        async with http.get(f"{console.url}/", allow_redirects=False) as page:
            assert page.status == 303 and page.headers["Location"] == "/login"
        async with http.get(f"{console.url}/api/overview") as api:
            assert api.status == 401
        async with http.post(f"{console.url}/env/{ENV_ID}/rollback") as action:
            assert action.status == 401


async def test_login_sets_a_strict_httponly_session_cookie_and_a_wrong_password_is_refused(console: Running) -> None:
    async with client() as http:
        wrong = await log_in(http, console.url, ADMIN_USER, "not the password")
        assert wrong.status == 401
        done = await log_in(http, console.url, ADMIN_USER)
        assert done.status == 303
        cookie = done.headers.getall("Set-Cookie")
        session = next(c for c in cookie if c.startswith("zattera_session="))
        assert "HttpOnly" in session and "SameSite=Strict" in session and "Secure" not in session
        async with http.get(f"{console.url}/") as page:  # streamed as rendered: the headers still apply
            assert "default-src 'self'" in page.headers["Content-Security-Policy"]
            assert page.headers["Cache-Control"] == "no-store" and page.headers["X-Frame-Options"] == "DENY"
            assert "shop/web/production" in await page.text()
        async with http.get(f"{console.url}/api/overview") as api:
            rows = (await api.json())["environments"]
        assert [(r["path"], r["active_release"], r["desired"]) for r in rows] == [("shop/web/production", "v2", 2)]


async def test_cookies_are_secure_when_configured(conn: Connection, view: StateView, writer: Writer) -> None:
    await add_users(conn)
    async with (
        running_console(conn, view, writer, secure_cookies=True) as running,
        client() as http,
        http.get(f"{running.url}/login") as page,
    ):
        assert "Secure" in page.headers["Set-Cookie"]


async def test_under_https_the_session_cookie_is_secure(
    conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await add_users(conn)
    files = generate(tmp_path, ["127.0.0.1"])
    trust = ssl.create_default_context(cafile=str(files.ca))
    async with (
        running_console(conn, view, writer, ssl_context=server_ssl_context(files.cert, files.key)) as running,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=trust), cookie_jar=aiohttp.CookieJar(unsafe=True)
        ) as http,
    ):
        assert running.url.startswith("https://")
        done = await log_in(http, running.url, ADMIN_USER)
        session = next(c for c in done.headers.getall("Set-Cookie") if c.startswith("zattera_session="))
        assert "Secure" in session and "HttpOnly" in session and "SameSite=Strict" in session


async def test_an_action_without_the_csrf_token_is_refused_and_writes_nothing(
    console: Running, view: StateView
) -> None:
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        async with http.post(f"{console.url}/env/{ENV_ID}/rollback", data={"release_id": "01REL1"}) as refused:
            assert refused.status == 403 and "CSRF" in await refused.text()
        wrong = {"release_id": "01REL1", "csrf": "forged"}
        async with http.post(f"{console.url}/env/{ENV_ID}/rollback", data=wrong) as refused:
            assert refused.status == 403
        assert view.deployments(ENV_ID) == []
        csrf = await csrf_of(http, console.url)
        headers = {"X-CSRF-Token": csrf, "Accept": "application/json"}
        async with http.post(f"{console.url}/env/{ENV_ID}/rollback", data={}, headers=headers) as done:
            assert done.status == 200, await done.text()
        assert [d.is_rollback for d in view.deployments(ENV_ID)] == [True]


async def test_a_viewer_sees_but_cannot_act(console: Running, view: StateView) -> None:
    async with client() as http:
        await log_in(http, console.url, VIEWER_USER)
        csrf = await csrf_of(http, console.url)
        async with http.post(f"{console.url}/nodes/n1/cordon", data={"csrf": csrf}) as refused:
            assert refused.status == 403 and "viewer role" in await refused.text()
        node = view.node("n1")
        assert node is not None and node.schedulable


async def test_failed_logins_are_limited_per_name_until_the_window_passes(console: Running) -> None:
    async with client() as http:
        for _ in range(LOGIN_FAILURES):
            assert (await log_in(http, console.url, ADMIN_USER, "wrong password!")).status == 401
        limited = await log_in(http, console.url, ADMIN_USER)  # even the right password waits
        assert limited.status == 429 and int(limited.headers["Retry-After"]) > 0
        await console.clock.advance(301)
        assert (await log_in(http, console.url, ADMIN_USER)).status == 303


async def test_a_removed_user_is_logged_out(console: Running, conn: Connection) -> None:
    async with client() as http:
        await log_in(http, console.url, VIEWER_USER)
        async with http.get(f"{console.url}/api/overview") as api:
            assert api.status == 200
        assert await remove_user(conn.js, VIEWER_USER)
        async with http.get(f"{console.url}/api/overview") as api:
            assert api.status == 401


async def test_a_secret_set_is_sealed_and_its_value_never_comes_back(console: Running, view: StateView) -> None:
    value = random_secret()
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        csrf = await csrf_of(http, console.url)
        form = {"csrf": csrf, "name": "API_TOKEN", "value": value}
        async with http.post(f"{console.url}/env/{ENV_ID}/secrets", data=form) as done:
            page = await done.text()
            assert done.status == 200 and "secret API_TOKEN set" in page and value not in page
        async with http.get(f"{console.url}/api/env/{ENV_ID}") as api:
            body = await api.text()
        assert "API_TOKEN" in body and value not in body
    sealed = [s for s in view.all(K.SECRET) if isinstance(s, pb.SealedSecret)]
    assert [s.name for s in sealed] == ["API_TOKEN"] and value.encode() not in sealed[0].ciphertext


async def test_a_failing_scheduled_backup_is_shown_on_the_overview_until_a_later_one_succeeds(
    console: Running, writer: Writer, view: StateView
) -> None:
    run = pb.BackupRun(ok=False, error="s3://b: NoSuchBucket: bucket b does not exist", failures=2)
    run.meta.id = SCHEDULE_ID
    run.started_at.FromSeconds(1_700_000_000)
    await writer.commit(writer.txn().put(run))
    async with client() as http:
        assert (await log_in(http, console.url, ADMIN_USER)).status == 303
        async with http.get(f"{console.url}/") as page:
            text = await page.text()
        assert 'id="backups-failing"' in text and "NoSuchBucket: bucket b does not exist" in text
        async with http.get(f"{console.url}/api/overview") as api:
            backups = (await api.json())["backups"]
        assert backups["failing"] and backups["failures"] == 2

        run.ok, run.error, run.failures, run.backup_id = True, "", 0, "01BACKUP"
        await writer.commit(writer.txn().put(run))
        await eventually(lambda: view.get(K.BACKUP_RUN, SCHEDULE_ID) == run)
        async with http.get(f"{console.url}/") as page:
            assert 'id="backups-failing"' not in await page.text()


async def test_a_failing_notification_channel_is_shown_on_the_overview_until_it_delivers(
    console: Running, writer: Writer, view: StateView
) -> None:
    status = pb.NotifyStatus(failing=True, failures=4, last_error="the receiver answered 503 Service Unavailable")
    status.meta.id = "ops"
    status.failing_since.FromSeconds(1_700_000_000)
    await writer.commit(writer.txn().put(status))
    async with client() as http:
        assert (await log_in(http, console.url, ADMIN_USER)).status == 303
        await eventually(lambda: view.get(K.NOTIFY_STATUS, "ops") == status)
        async with http.get(f"{console.url}/") as page:
            text = await page.text()
        assert 'id="channels-failing"' in text and "channel ops FAILING since 2023-11-14 22:13:20 UTC" in text
        async with http.get(f"{console.url}/api/overview") as api:
            failing = (await api.json())["notifications"]["failing"]
        assert len(failing) == 1 and "answered 503" in failing[0]

        status.failing, status.failures, status.last_error = False, 0, ""
        await writer.commit(writer.txn().put(status))
        await eventually(lambda: view.get(K.NOTIFY_STATUS, "ops") == status)
        async with http.get(f"{console.url}/") as page:
            assert 'id="channels-failing"' not in await page.text()
