"""``zattera apps apply`` with ``[addons.NAME]``: the plan lists the databases and attachments, apply creates
and attaches them, applying again changes nothing; a refusal names the file's key."""

from __future__ import annotations

import json
from pathlib import Path

from shared.actions.addons import list_addons
from tests.addons.test_actions import _key
from tests.cli.rig import state

SPEC = """
project = "shop"
app = "web"

[env.production]
replicas = 1

[addons.orders]
type = "postgres"
attach = ["production"]
"""


def _seed_key(nats_url: str) -> None:
    async def seed(conn, view, writer) -> None:  # type: ignore[no-untyped-def]
        await writer.commit(writer.txn().create(_key()[1]))

    state(nats_url, seed)


def test_apply_creates_and_attaches_the_declared_database_once(cli, nats_url: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _seed_key(nats_url)
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    planned = json.loads(cli("apps", "apply", str(spec), "--dry-run", "--json").stdout)
    assert [
        (i["action"], i["kind"], i["name"]) for i in planned["plan"] if i["kind"] in ("database", "attachment")
    ] == [
        ("create", "database", "orders"),
        ("create", "attachment", "orders → shop/web/production"),
    ]
    applied = cli("apps", "apply", str(spec))
    assert applied.exit_code == 0, applied.output
    assert "database orders" in applied.stdout and "attachment orders → shop/web/production" in applied.stdout

    async def databases(conn, view, writer):  # type: ignore[no-untyped-def]
        return [(i.name, i.engine, i.attached_to) for i in list_addons(view)]

    assert state(nats_url, databases) == [("orders", "postgres", ["shop/web/production"])]
    again = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert {i["action"] for i in again["plan"]} == {"unchanged"}
    spec.write_text(SPEC.replace('type = "postgres"', 'type = "redis"'))
    refused = cli("apps", "apply", str(spec))
    assert refused.exit_code == 1
    assert "addons.orders.type: orders is a postgres database already" in refused.output
