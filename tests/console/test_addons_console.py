"""Managed databases from the console (services/console/addons.py) on real NATS: the list with engine,
version, state and the recoverable window the instance reported; create, attach, detach and a restore as a
fork through the same actions as the CLI, each POST needing the CSRF token and a role that may act; a
refusal names the field; no password on the page or in the API."""

from __future__ import annotations

import json

import aiohttp
from google.protobuf.timestamp_pb2 import Timestamp
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.addons import spec as addon
from shared.applogs import LogLimits, app_log_subject, app_logs_stream_config
from shared.connection import Connection
from shared.provisioning import create_or_update_stream
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import ADMIN_USER, ENV_ID, VIEWER_USER, Running
from tests.console.test_auth import client, csrf_of, log_in

WEB = "shop/web/production"


async def _post(
    http: aiohttp.ClientSession, url: str, csrf: str, form: dict[str, str]
) -> tuple[int, dict[str, object]]:
    headers = {"X-CSRF-Token": csrf, "Accept": "application/json"}
    async with http.post(url, data=form, headers=headers) as answer:
        return answer.status, await answer.json()


async def _rows(http: aiohttp.ClientSession, url: str) -> list[dict[str, object]]:
    async with http.get(f"{url}/api/addons") as answer:
        assert answer.status == 200
        body = await answer.json()
    rows: list[dict[str, object]] = body["addons"]
    return rows


async def _report(conn: Connection, env_id: str, started: float, stopped: float, archived: float) -> None:
    """The instance's backup report lines in its log stream, as the entry script prints them."""
    await create_or_update_stream(conn.js, app_logs_stream_config(env_id, LogLimits(1 << 20, 3600.0), 1))
    info = [
        {
            "name": "orders",
            "backup": [
                {
                    "label": "20261202-170000F",
                    "type": "full",
                    "timestamp": {"start": started, "stop": stopped},
                    "info": {"size": 1000, "repository": {"delta": 100}},
                    "archive": {"start": "000000010000000000000003", "stop": "000000010000000000000003"},
                }
            ],
        }
    ]
    batch = cpb.InstanceLogBatch(environment_id=env_id, instance_id="I1", node_id="n1", release_id="R1")
    for text in (
        f"zattera-addon-backups {json.dumps(info)}",
        f"zattera-addon-archived time={archived} wal=000000010000000000000007 failed=0",
    ):
        stamp = Timestamp()
        stamp.FromSeconds(int(archived) + 1)
        batch.lines.add(time=stamp, stream="stderr", line=text)
    await conn.js.publish(app_log_subject(env_id, "I1"), batch.SerializeToString())


async def test_databases_are_listed_created_attached_detached_and_forked_from_the_console(
    console: Running, conn: Connection, view: StateView, writer: Writer
) -> None:
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        csrf = await csrf_of(http, console.url)
        assert await _rows(http, console.url) == []
        # without the CSRF token: refused, nothing written
        async with http.post(f"{console.url}/addons/create", data={"engine": "postgres", "name": "orders"}) as r:
            assert r.status == 403
        assert await _rows(http, console.url) == []
        # bad input: one line naming the field
        status, refused = await _post(
            http, f"{console.url}/addons/create", csrf, {"engine": "mysql", "name": "orders", "project": "shop"}
        )
        assert status == 409 and refused == {"error": "engine: unknown engine 'mysql': one of postgres, redis"}
        status, created = await _post(
            http, f"{console.url}/addons/create", csrf, {"engine": "postgres", "name": "orders", "project": "shop"}
        )
        assert status == 200 and created["ok"], created
        db_env = str(created["env_id"])
        [row] = await _rows(http, console.url)
        assert (row["name"], row["project"], row["engine"], row["version"]) == ("orders", "shop", "postgres", "15")
        assert row["address"] == "orders.db.shop.internal:5432" and row["window"] is None
        assert row["consumers"] == [WEB]
        # the instance's report gives the recoverable window
        await _report(conn, db_env, 1_796_000_000.0, 1_796_000_010.0, 1_796_000_500.0)
        [row] = await _rows(http, console.url)
        assert isinstance(row["window"], dict)
        assert (row["window"]["start"], row["window"]["end"]) == (1_796_000_010.0, 1_796_000_500.0)
        async with http.get(f"{console.url}/addons?project=shop") as page:
            html = await page.text()
        assert "shop/orders" in html and "Recoverable window: 2026-" in html and "1 base backup(s)" in html
        # attach, through the same action: the consumer gets DATABASE_URL (sealed)
        status, attached = await _post(http, f"{console.url}/env/{db_env}/addon/attach", csrf, {"env": WEB})
        assert status == 200, attached
        web = view.env(ENV_ID)
        assert web is not None and "DATABASE_URL" in web.service.secrets
        [row] = await _rows(http, console.url)
        assert row["attached_to"] == [WEB] and row["consumers"] == []
        status, twice = await _post(http, f"{console.url}/env/{db_env}/addon/attach", csrf, {"env": WEB, "deploy": "0"})
        assert status == 409 and twice["error"] == "orders is already attached to this env", twice
        # a restore time in the future is refused naming it; a fork needs its volumes placed first
        status, future = await _post(
            http, f"{console.url}/env/{db_env}/addon/restore", csrf, {"as_name": "fork", "to_time": "2999-01-01T00:00Z"}
        )
        assert status == 409 and str(future["error"]).startswith("to_time: 2999-01-01 00:00:00 UTC is in the future")
        backups = (
            next(v for v in view.volumes(db_env) if v.name == addon.BACKUPS_VOLUME) if view.volumes(db_env) else None
        )
        if backups is None:  # the first deploy places the volumes; here no scheduler runs: place it by hand
            volume = pb.Volume(project_id="01PROJ", environment_id=db_env, name=addon.BACKUPS_VOLUME, node_id="n1")
            volume.meta.id = "01VOLBACKUPS"
            volume.status = pb.VOLUME_STATUS_ACTIVE
            await writer.commit(writer.txn().create(volume))
        status, fork = await _post(
            http, f"{console.url}/env/{db_env}/addon/restore", csrf, {"as_name": "orders-copy", "latest": "1"}
        )
        assert status == 200, fork
        names = {str(r["name"]): r for r in await _rows(http, console.url)}
        assert set(names) == {"orders", "orders-copy"} and names["orders-copy"]["restored_from"] == "shop/orders"
        # detach
        status, detached = await _post(
            http, f"{console.url}/env/{db_env}/addon/detach", csrf, {"env": WEB, "deploy": "0"}
        )
        assert status == 200, detached
        web = view.env(ENV_ID)
        assert web is not None and "DATABASE_URL" not in web.service.secrets
        # an env that is no database
        status, nope = await _post(http, f"{console.url}/env/{ENV_ID}/addon/detach", csrf, {"env": WEB})
        assert status == 409 and "no database" in str(nope["error"])
        # no password anywhere the console answered
        secrets = [s.ciphertext for s in view.secrets(db_env)]
        assert secrets and all(len(c) > 32 for c in secrets)
        async with http.get(f"{console.url}/api/addons") as answer:
            body = await answer.text()
        assert "postgresql://" not in body and "PASSWORD" not in body


async def test_a_viewer_sees_the_databases_but_cannot_create_or_attach(console: Running) -> None:
    async with client() as http:
        await log_in(http, console.url, VIEWER_USER)
        csrf = await csrf_of(http, console.url)
        assert await _rows(http, console.url) == []
        status, refused = await _post(
            http, f"{console.url}/addons/create", csrf, {"engine": "postgres", "name": "orders", "project": "shop"}
        )
        assert status == 403 and "cannot act" in str(refused["error"])
        assert await _rows(http, console.url) == []
