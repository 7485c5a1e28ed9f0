"""``zattera audit`` on an open cluster (docs/audit.md): the CLI records its own writes with the OS user it
claims, ``verified: false``; the entries name keys and the command, never a value (a secret's included)."""

from __future__ import annotations

import json
import secrets as pysecrets

from nacl.public import PrivateKey

from shared.audit import local_user
from tests.cli.rig import Invoke
from tests.cli.test_config_secrets import ENV, applied, cluster_key

__all__ = ["applied", "cluster_key"]  # fixtures used by the tests below


def test_open_cluster_writes_are_audited_as_claimed_and_hold_no_value(cli: Invoke, cluster_key: PrivateKey) -> None:
    value = "s3cr3t-" + pysecrets.token_hex(16)
    assert cli("secrets", "set", "--env", ENV, "API_TOKEN", "--no-deploy", input=value + "\n").exit_code == 0
    listed = cli("audit", "--json")
    assert listed.exit_code == 0, listed.output
    entries = json.loads(listed.stdout)
    assert entries, "no audit entry"
    assert value not in listed.stdout and value not in cli("audit", "--wide").output
    newest = entries[0]  # newest first
    assert newest["source"] == "cli" and newest["verified"] is False and newest["verified_by"] == ""
    assert newest["user"] == local_user() and newest["action"] == "secrets set" and newest["action_claimed"]
    assert newest["outcome"] == "ok" and newest["request_id"]
    assert any("API_TOKEN" in k["key"] or k["key"].startswith("secret") for k in newest["keys"]), newest
    applied = [e for e in entries if e["action"] == "apps apply"]
    assert applied and all(e["time_ns"] <= newest["time_ns"] for e in applied)
    assert {"id", "time", "operation", "keys", "address", "credential", "claimed_user", "seq"} <= newest.keys()

    only = json.loads(cli("audit", "--json", "--limit", "1", "--user", local_user()).stdout)
    assert [e["id"] for e in only] == [newest["id"]]
    assert json.loads(cli("audit", "--json", "--user", "nobody-else").stdout) == []
    assert json.loads(cli("audit", "--json", "--since", "1h").stdout)[0]["id"] == newest["id"]
    table = cli("audit")
    assert table.exit_code == 0 and "secrets set" in table.output and local_user() in table.output


def test_bad_audit_options_name_the_option(cli: Invoke) -> None:
    bad = cli("audit", "--since", "yesterday")
    assert bad.exit_code == 1 and "--since 'yesterday': expected a duration like 30m, 2h or 7d" in bad.output
    negative = cli("audit", "--limit", "-1")
    assert negative.exit_code == 1 and "--limit -1: must be 0 or more" in negative.output
