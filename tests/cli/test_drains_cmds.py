"""``zattera drains add|list|remove`` and the drain lines of ``zattera status`` as an operator runs them against
a real nats-server: credentials in the URL, the headers and the CA never shown back, bad input naming the
option."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from tests.backup.test_drill import cluster, publish_key
from tests.cli.rig import initialised_cli

PASSWORD = "pa55-never-shown-0c1d"
TOKEN = "tok-never-shown-77aa"
BEARER = "bearer-never-shown-4e2f"


def test_drains_commands_round_trip(nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zattera = initialised_cli(nats_url)

    async def setup() -> None:
        async with cluster(nats_url, tmp_path) as c:
            await publish_key(c)
            project = pb.Project(name="shop")
            project.meta.id = "01PROJ"
            await c.ctx.writer.commit(c.ctx.writer.txn().create(project))

    asyncio.run(setup())
    monkeypatch.setenv("ZATTERA_DRAIN_URL", f"https://bob:{PASSWORD}@logs.example.com:8443/in?token={TOKEN}")
    added = zattera("drains", "add", "ship", "--project", "shop", "--events", "--header", f"Authorization: {BEARER}")
    assert added.exit_code == 0, added.output
    assert (
        "drain ship added: logs and platform events of project shop to https://logs.example.com:8443/…" in added.output
    )
    listed = zattera("drains", "list", "--json")
    assert listed.exit_code == 0, listed.output
    [drain] = json.loads(listed.stdout)
    assert drain["name"] == "ship" and drain["scope"] == "project shop" and drain["events"] is True
    assert drain["url"] == "https://logs.example.com:8443/…" and not drain["failing"] and drain["dropped_messages"] == 0
    table = zattera("drains", "list")
    assert "ship" in table.output and "project shop +events" in table.output
    status = zattera("status")
    assert status.exit_code == 0 and "drains: ship (project shop → https://logs.example.com:8443/…) ok" in status.output
    for result in (added, listed, table, status):
        for secret in (PASSWORD, TOKEN, BEARER):
            assert secret not in result.output

    monkeypatch.delenv("ZATTERA_DRAIN_URL")
    bad = zattera("drains", "add", "ship2", "--project", "shop", "--url", f"syslog://u:{PASSWORD}@h:514")
    assert bad.exit_code != 0 and "--url: the scheme syslog:// is not one of" in bad.output
    assert PASSWORD not in bad.output
    both = zattera("drains", "add", "ship2", "--url", "https://h/x")
    assert both.exit_code != 0 and "--env: give one of --env or --project" in both.output
    header = zattera("drains", "add", "ship2", "--project", "shop", "--url", "https://h/x", "--header", "nocolon")
    assert header.exit_code != 0 and "--header: a header is 'Name: value'" in header.output
    ca = zattera(
        "drains", "add", "ship2", "--project", "shop", "--url", "https://h/x", "--ca-file", str(tmp_path / "no")
    )
    assert ca.exit_code != 0 and "--ca-file: cannot read" in ca.output
    missing = zattera("drains", "add", "ship2", "--project", "shop")
    assert missing.exit_code != 0 and "--url" in missing.output

    removed = zattera("drains", "remove", "ship")
    assert removed.exit_code == 0 and "drain ship removed" in removed.output
    gone = zattera("drains", "remove", "ship")
    assert gone.exit_code != 0 and "no drain 'ship'" in gone.output
