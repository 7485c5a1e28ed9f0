"""The console records its users' writes in the audit log (docs/audit.md) — the logged-in user, verified by
the console's login, the form's action, the browser's address, no value — and lists them on /audit."""

from __future__ import annotations

from shared.audit import AuditLog
from shared.connection import Connection
from tests.console.rig import ADMIN_USER, ENV_ID, VIEWER_USER, Running, random_secret
from tests.console.test_auth import client, csrf_of, log_in


async def test_a_console_write_is_audited_as_the_logged_in_user(console: Running, conn: Connection) -> None:
    console.console.audit = AuditLog(conn)
    value = random_secret()
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        headers = {"X-CSRF-Token": await csrf_of(http, console.url), "Accept": "application/json"}
        form = {"name": "API_TOKEN", "value": value}
        async with http.post(f"{console.url}/env/{ENV_ID}/secrets", data=form, headers=headers) as done:
            assert done.status == 200, await done.text()
        async with http.post(f"{console.url}/env/{ENV_ID}/scale", json={"replicas": "3"}, headers=headers) as done:
            assert done.status == 200, await done.text()
        async with http.get(f"{console.url}/api/audit") as api:
            assert api.status == 200
            body = await api.text()
            entries = (await api.json())["entries"]
        async with http.get(f"{console.url}/audit?since=1h") as page:
            html = await page.text()
        async with http.get(f"{console.url}/audit?since=soon") as bad:
            assert bad.status == 400 and "expected a duration" in await bad.text()
        async with http.get(f"{console.url}/api/audit?limit=1&user={VIEWER_USER}") as none:
            assert (await none.json())["entries"] == []
    assert value not in body and value not in html
    scaled, secret = entries[0], entries[1]  # newest first
    for entry in (scaled, secret):
        assert entry["source"] == "console" and entry["user"] == ADMIN_USER and entry["verified"] is True
        assert entry["verified_by"] == "console-login" and entry["address"] == "127.0.0.1"
        assert entry["outcome"] == "ok" and entry["seq"] == 0 and entry["request_id"]
    assert scaled["action"] == "scale" and not scaled["action_claimed"]
    assert scaled["keys"] == [{"key": f"env.{ENV_ID}", "op": "put"}], scaled
    assert secret["action"] == "secret" and any("secret" in k["key"] for k in secret["keys"]), secret
    assert "Audit log" in html and "scale" in html and ADMIN_USER in html
