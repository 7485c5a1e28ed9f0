"""``zattera apps apply --dry-run``: the plan, object by object and field by field, and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

from shared.subjects import STATE_STREAM
from tests.cli.rig import state

BASE = """
project = "demo"
app = "hello"

[env.production]
replicas = { min = 2, max = 4 }
domains = ["hello.example.com", "old.example.com"]
"""

CHANGED = """
project = "demo"
app = "hello"

[env.production]
replicas = { min = 3, max = 4 }
domains = ["hello.example.com", "www.example.com"]

[env.production.middleware]
redirect_https = true
basic_auth = [{ username = "ops", password_hash = "$2b$04$abcdefghijklmnopqrstuu5Zg0v0nFvyvVw6gq0ztVYv8CZqUhE5a" }]

[env.staging]
replicas = 1
"""


def _last_sequence(nats_url: str) -> int:
    async def read(conn, view, writer) -> int:
        return (await conn.js.stream_info(STATE_STREAM)).state.last_seq

    return state(nats_url, read)


def test_dry_run_prints_the_plan_and_writes_nothing(cli, nats_url, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(BASE)
    assert cli("apps", "apply", str(spec)).exit_code == 0
    spec.write_text(CHANGED)
    before = _last_sequence(nats_url)

    result = cli("apps", "apply", str(spec), "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    lines = out.splitlines()
    assert any(line.startswith("  project demo") and line.endswith("unchanged") for line in lines)
    assert any(line.startswith("~ env demo/hello/production") and "update" in line for line in lines)
    assert "      service.replicas.min: 2 → 3" in lines
    assert "      middleware.redirect_https: (none) → true" in lines
    assert "      middleware.basic_auth_password_hash: (hidden value changed)" in lines
    assert "$2b$" not in out  # a hash is never printed
    assert any(line.startswith("+ env demo/hello/staging") for line in lines)
    assert any(line.startswith("+ domain www.example.com") and "demo/hello/production" in line for line in lines)
    assert any(line.startswith("- domain old.example.com") for line in lines)
    assert "Plan: 2 to create, 1 to change, 1 to remove, 3 unchanged. Nothing was written (--dry-run)." in out
    assert _last_sequence(nats_url) == before

    as_json = json.loads(cli("apps", "apply", str(spec), "--dry-run", "--json").stdout)
    assert as_json["dry_run"] is True
    assert as_json["summary"] == {"create": 2, "update": 1, "delete": 1, "unchanged": 3}
    env = next(i for i in as_json["plan"] if i["name"] == "demo/hello/production")
    assert {"field": "service.replicas.min", "old": 2, "new": 3, "sensitive": False} in env["changes"]
    hidden = {"field": "middleware.basic_auth_password_hash", "old": None, "new": None, "sensitive": True}
    assert hidden in env["changes"]
    assert _last_sequence(nats_url) == before

    applied = cli("apps", "apply", str(spec))  # the plan is what apply then does, and shows
    assert "      service.replicas.min: 2 → 3" in applied.stdout.splitlines()
    assert "Applied: 2 created, 1 changed, 1 removed, 3 unchanged." in applied.stdout
    assert _last_sequence(nats_url) > before
    again = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert again["dry_run"] is False and again["summary"] == {"create": 0, "update": 0, "delete": 0, "unchanged": 6}


def test_dry_run_on_an_empty_cluster_lists_creations_only(cli, nats_url, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(BASE)
    before = _last_sequence(nats_url)
    plan = json.loads(cli("apps", "apply", str(spec), "--dry-run", "--json").stdout)
    assert [(i["action"], i["kind"], i["name"]) for i in plan["plan"]] == [
        ("create", "project", "demo"),
        ("create", "app", "demo/hello"),
        ("create", "env", "demo/hello/production"),
        ("create", "domain", "hello.example.com"),
        ("create", "domain", "old.example.com"),
    ]
    env = plan["plan"][2]
    assert {"field": "service.replicas.min", "old": None, "new": 2, "sensitive": False} in env["changes"]
    assert all(c["new"] != {} for c in env["changes"])  # empty tables are not fields
    assert all(not c["field"].endswith("_id") and not c["field"].startswith("meta.") for c in env["changes"])
    assert _last_sequence(nats_url) == before

    async def nothing(conn, view, writer):
        assert view.envs() == [] and view.all("project") == []

    state(nats_url, nothing)
