"""Teams in the console (docs/teams.md), over real HTTP against a real NATS server: a project member sees and
acts on its projects only, an API token works on the JSON API until revoked, admins see the teams page."""

from __future__ import annotations

import time

import aiohttp
from zattera.v1 import types_pb2 as pb

from shared.connection import Connection
from shared.console_users import ADMIN, new_user
from shared.console_users import save_user as save_console_user
from shared.security.authz import ensure_teams_bucket
from shared.security.creds import creds_text
from shared.security.nkeyjwt import KeyKind, KeyPair, encode_jwt
from shared.teams import DEPLOYER, VIEWER, Token, User, encode_token, hash_token
from shared.teams_store import save_token, save_user
from shared.txn import Writer
from tests import factories
from tests.console.rig import ADMIN_USER, ENV_ID, PASSWORD, Running
from tests.console.test_auth import client, csrf_of, log_in

OTHER_ENV = "02ENVOTHER"


async def other_project(writer: Writer) -> None:
    project = pb.Project(name="other")
    project.meta.id = "02PROJ"
    app = pb.App(project_id="02PROJ", name="api")
    app.meta.id = "02APP"
    env = factories.env(OTHER_ENV, project_id="02PROJ", app_id="02APP")
    env.name = "prod"
    txn = writer.txn()
    for message in (project, app, env):
        txn.create(message)
    await writer.commit(txn)


def token_for(name: str) -> str:
    """A token wrapping a credential named ``token:<name>`` (the console reads the name, never the seed)."""
    signer, user = KeyPair.generate(KeyKind.ACCOUNT), KeyPair.generate(KeyKind.USER)
    jwt = encode_jwt(issuer=signer, subject=user.public_key, name=f"token:{name}", nats={"type": "user"})
    return encode_token(creds_text(jwt, user.seed))


async def test_a_member_sees_and_acts_on_its_projects_only(conn: Connection, writer: Writer, console: Running) -> None:
    await other_project(writer)
    await ensure_teams_bucket(conn)
    await save_console_user(conn.js, new_user("tina", ADMIN, PASSWORD, rounds=4))
    await save_user(conn.js, User("tina", "UKEY", False, {"01PROJ": DEPLOYER}))
    async with client() as http:
        (await log_in(http, console.url, "tina")).close()
        async with http.get(f"{console.url}/api/overview") as overview:
            body = await overview.json()
        assert [e["id"] for e in body["environments"]] == [ENV_ID], body
        async with http.get(f"{console.url}/api/env/{OTHER_ENV}") as other:
            assert other.status == 404
        async with http.get(f"{console.url}/") as page:  # the overview's cards (issue 40), its projects only
            html = await page.text()
            assert page.status == 200 and ENV_ID in html and OTHER_ENV not in html, html[-400:]
        for charts in (f"/api/env/{OTHER_ENV}/metrics", f"/env/{OTHER_ENV}/charts"):  # another project's history
            async with http.get(f"{console.url}{charts}", headers={"Accept": "application/json"}) as refused:
                assert refused.status == 404, charts
        async with http.get(f"{console.url}/api/env/{ENV_ID}/metrics") as own:
            assert own.status == 200, await own.text()
        for page in (
            "/nodes",
            "/nodes/n1",
            "/api/nodes/n1/metrics",
            "/events",
            "/audit",
            "/volumes",
            "/builds",
            "/admin/teams",
        ):
            async with http.get(f"{console.url}{page}", headers={"Accept": "application/json"}) as refused:
                assert refused.status == 403, page
        csrf = await csrf_of(http, console.url)
        headers = {"X-CSRF-Token": csrf, "Accept": "application/json"}
        async with http.post(f"{console.url}/env/{OTHER_ENV}/scale", data={"replicas": "3"}, headers=headers) as no:
            assert no.status == 404
        async with http.post(f"{console.url}/env/{ENV_ID}/scale", data={"replicas": "3"}, headers=headers) as ok:
            assert ok.status in (200, 303), await ok.text()
        # The grant taken back: the next request is refused.
        await save_user(conn.js, User("tina", "UKEY", False, {"01PROJ": VIEWER}))
        async with http.post(f"{console.url}/env/{ENV_ID}/scale", data={"replicas": "2"}, headers=headers) as no:
            assert no.status == 403 and "viewer" in (await no.json())["error"]


async def test_an_api_token_reads_its_project_and_fails_once_revoked(
    conn: Connection, writer: Writer, console: Running
) -> None:
    await other_project(writer)
    await ensure_teams_bucket(conn)
    token = token_for("ci")
    record = Token("ci", "01PROJ", VIEWER, "UKEY", hash_token(token), time.time() + 3600, time.time(), "test")
    await save_token(conn.js, record)
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{console.url}/api/overview", headers=auth) as overview:
            assert [e["id"] for e in (await overview.json())["environments"]] == [ENV_ID]
        async with http.get(f"{console.url}/api/env/{ENV_ID}", headers=auth) as env:
            assert env.status == 200
        async with http.post(f"{console.url}/env/{ENV_ID}/scale", data={"replicas": "3"}, headers=auth) as no:
            assert no.status == 403  # a viewer's token cannot act
        forged = token_for("ci")  # same name, another secret: its hash does not match
        async with http.get(f"{console.url}/api/overview", headers={"Authorization": f"Bearer {forged}"}) as bad:
            assert bad.status == 401
        record.revoked = True
        await save_token(conn.js, record)
        async with http.get(f"{console.url}/api/overview", headers=auth) as revoked:
            assert revoked.status == 401 and "revoked" in (await revoked.json())["error"]


async def test_admins_see_the_teams_page_and_grant_roles(conn: Connection, writer: Writer, console: Running) -> None:
    await ensure_teams_bucket(conn)
    await save_user(conn.js, User("carl", "UKEY", False, {}))
    async with client() as http:
        (await log_in(http, console.url, ADMIN_USER)).close()
        csrf = await csrf_of(http, console.url)
        form = {"user": "carl", "project": "01PROJ", "role": "owner", "csrf": csrf}
        async with http.post(f"{console.url}/admin/teams/grant", data=form, allow_redirects=False) as done:
            assert done.status == 303
        async with http.get(f"{console.url}/admin/teams", headers={"Accept": "application/json"}) as page:
            users = (await page.json())["users"]
        assert {"name": "carl", "admin": False, "grants": [["shop", "01PROJ", "owner"]]} in users
        async with http.get(f"{console.url}/admin/teams") as html:
            assert "carl" in await html.text()
