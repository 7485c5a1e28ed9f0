"""`zattera console add-user|list-users|remove-user` against a real NATS server."""

from __future__ import annotations

import json
from typing import Any

from shared.console_users import load_user, password_matches, users_bucket
from shared.state.feed import StateView
from shared.txn import Writer
from tests.cli.rig import Invoke, initialised_cli, state

PASSWORD = "a long enough password"


def _console_started(nats_url: str) -> None:
    async def create(conn: Any, view: StateView, writer: Writer) -> None:
        await users_bucket(conn.js, create=True)

    state(nats_url, create)


def test_add_user_stores_only_a_bcrypt_hash_and_lists_names_and_roles(nats_url: str) -> None:
    cli: Invoke = initialised_cli(nats_url)
    early = cli("console", "add-user", "vic", input=PASSWORD + "\n")
    assert early.exit_code == 1 and "no zattera-console bucket yet: start the console once" in early.output
    _console_started(nats_url)
    added = cli("console", "add-user", "vic", "--role", "viewer", input=PASSWORD + "\n")
    assert added.exit_code == 0, added.output
    assert PASSWORD not in added.output

    async def check(conn: Any, view: StateView, writer: Writer) -> None:
        user = await load_user(conn.js, "vic")
        assert user is not None and user.role == "viewer"
        assert user.password_bcrypt.startswith("$2") and password_matches(user, PASSWORD)

    state(nats_url, check)
    listed = cli("console", "list-users", "--json")
    assert json.loads(listed.output) == [
        {"name": "vic", "role": "viewer", "created_at": json.loads(listed.output)[0]["created_at"]}
    ]
    assert "$2" not in listed.output
    assert cli("console", "remove-user", "vic").exit_code == 0
    assert json.loads(cli("console", "list-users", "--json").output) == []


def test_bad_input_is_refused_naming_the_field_and_nothing_is_written(nats_url: str) -> None:
    cli: Invoke = initialised_cli(nats_url)
    _console_started(nats_url)
    short = cli("console", "add-user", "ada", input="short\n")
    assert short.exit_code == 1 and "password: must be 10 to 72 bytes long" in short.output
    role = cli("console", "add-user", "ada", "--role", "root", input=PASSWORD + "\n")
    assert role.exit_code == 1 and "--role 'root'" in role.output
    name = cli("console", "add-user", "Ada Lovelace", input=PASSWORD + "\n")
    assert name.exit_code == 1 and "name 'Ada Lovelace'" in name.output
    assert json.loads(cli("console", "list-users", "--json").output) == []
    missing = cli("console", "remove-user", "nobody")
    assert missing.exit_code == 1 and "not found" in missing.output
