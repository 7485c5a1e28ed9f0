"""``zattera domains add|list|remove`` against a real NATS server (certificate records written as the
certificate loop would)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zattera.v1 import types_pb2 as pb

from shared import certs as C
from shared import keys as K
from shared.clock import to_timestamp
from shared.state.feed import StateView
from shared.txn import Writer
from tests.cli.rig import Invoke, state
from tests.cli.test_config_secrets import ENV, SPEC


def test_add_list_remove_with_certificate_states(cli: Invoke, nats_url: str, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    assert cli("apps", "apply", str(spec)).exit_code == 0
    for host in ("www.example.com", "api.example.com"):
        added = cli("domains", "add", host, "--env", ENV)
        assert added.exit_code == 0, added.output
    assert "already routed to demo/hello/production" in cli("domains", "add", "www.example.com", "--env", ENV).output

    async def failed_and_valid(conn: Any, view: StateView, writer: Writer) -> None:
        failed = C.after_failure(C.pending_record("api.example.com", "https://ca/dir"), "rateLimited: slow", 60, 1e9)
        valid = C.pending_record("www.example.com", "https://ca/dir")
        valid.state, valid.chain_pem = C.VALID, "CHAIN"
        valid.not_after.CopyFrom(to_timestamp(4e9))
        valid.renew_at.CopyFrom(to_timestamp(3e9))
        await writer.commit(writer.txn().create(failed).create(valid))

    state(nats_url, failed_and_valid)
    rows = {r["hostname"]: r for r in json.loads(cli("domains", "list", "--json").output)}
    assert rows["api.example.com"]["state"] == "failed" and rows["api.example.com"]["error"] == "rateLimited: slow"
    assert rows["www.example.com"]["state"] == "valid" and rows["www.example.com"]["valid_until"] == 4e9
    assert rows["www.example.com"]["environment"] == ENV
    table = cli("domains", "list").output
    assert "rateLimited: slow" in table and "2096-" in table  # valid until 4e9

    assert cli("domains", "remove", "api.example.com").exit_code == 0
    gone = cli("domains", "remove", "api.example.com")
    assert gone.exit_code == 1 and "hostname: no domain 'api.example.com'" in gone.output

    async def hostnames(conn: Any, view: StateView, writer: Writer) -> set[str]:
        return {d.hostname for d in view.all(K.DOMAIN) if isinstance(d, pb.Domain)}

    assert state(nats_url, hostnames) == {"www.example.com"}


def test_a_bad_hostname_is_refused_naming_the_field(cli: Invoke) -> None:
    done = cli("domains", "add", "*.example.com", "--env", ENV)
    assert done.exit_code == 1 and "hostname: '*.example.com' is a wildcard" in done.output
