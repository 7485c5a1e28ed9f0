"""``zattera addons`` against a real NATS server: what it prints, one-line refusals naming the option as the
command spells it, ``--json``, and no password in anything it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nacl.public import PrivateKey

from tests.cli.rig import Invoke, initialised_cli
from tests.cli.test_config_secrets import ENV, applied, cluster_key

__all__ = ["applied", "cluster_key"]  # fixtures of the secrets CLI tests


@pytest.fixture
def cli(nats_url: str) -> Invoke:
    return initialised_cli(nats_url)


def test_create_list_info_attach_and_refusals(cli: Invoke, applied: Path, cluster_key: PrivateKey) -> None:
    created = cli("addons", "create", "postgres", "orders", "--project", "demo", "--json")
    assert created.exit_code == 0, created.output
    info = json.loads(created.output[created.output.index("{") :])
    assert info["address"] == "orders.db.demo.internal:5432" and info["env"] == "demo/orders/db"
    listed = json.loads(cli("addons", "list", "--json").output)
    assert [row["name"] for row in listed] == ["orders"]
    shown = cli("addons", "info", "orders", "--project", "demo")
    assert shown.exit_code == 0 and "postgres 15" in shown.output
    attached = cli("addons", "attach", "orders", "--env", ENV)
    assert attached.exit_code == 0 and "attached to demo/hello/production" in attached.output, attached.output
    for args, expected in [
        (("create", "mysql", "x", "--project", "demo"), "ENGINE: unknown engine 'mysql'"),
        (("create", "postgres", "x", "--project", "demo", "--version", "9"), "--version: postgres 9 is not available"),
        (("create", "postgres", "orders", "--project", "demo"), "NAME: 'orders' is already an app of project demo"),
        (("create", "postgres", "x", "--project", "nope"), "--project: no project 'nope'"),
        (("attach", "gone", "--env", ENV), "NAME: no database 'gone' in project demo"),
        (("restore", "orders", "--project", "demo", "--as", "y"), "--to-time: give --to-time T or --latest"),
        (
            ("restore", "orders", "--project", "demo", "--as", "y", "--to-time", "soon"),
            "--to-time: 'soon' is not a time",
        ),
        (("restore", "orders", "--project", "demo", "--as", "y", "--to-time", "2999-01-01T00:00:00Z"), "in the future"),
        (("delete", "orders", "--project", "demo"), "NAME: attached to demo/hello/production: detach first"),
    ]:
        done = cli("addons", *args)
        assert done.exit_code == 1, (args, done.output)
        assert expected in done.output and done.output.strip().count("\n") == 0, (args, done.output)
    everything = created.output + listed.__repr__() + shown.output + attached.output
    assert "postgresql://" not in everything
