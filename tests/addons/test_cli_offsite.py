"""``zattera addons offsite`` / ``restore --from`` / ``psql`` against a real NATS server: one-line refusals
naming the argument or option as the command spells it."""

from __future__ import annotations

from pathlib import Path

import pytest
from nacl.public import PrivateKey

from tests.cli.rig import Invoke, initialised_cli
from tests.cli.test_config_secrets import applied, cluster_key

__all__ = ["applied", "cluster_key"]  # fixtures of the secrets CLI tests


@pytest.fixture
def cli(nats_url: str) -> Invoke:
    return initialised_cli(nats_url)


def test_offsite_restore_and_psql_refusals(cli: Invoke, applied: Path, cluster_key: PrivateKey) -> None:
    assert cli("addons", "create", "postgres", "orders", "--project", "demo").exit_code == 0
    assert cli("addons", "create", "redis", "cache", "--project", "demo").exit_code == 0
    for args, expected in [
        (("offsite", "orders", "s3://b/p", "--project", "demo"), "NAME: orders has no backups volume yet"),
        (("offsite", "cache", "s3://b/p", "--project", "demo"), "NAME: cache is not a PostgreSQL database"),
        (("offsite", "gone", "s3://b/p", "--project", "demo"), "NAME: no database 'gone' in project demo"),
        (
            ("restore", "orders", "--project", "demo", "--as", "copy", "--latest", "--from", "s3://b/p"),
            "NAME: orders has no backups volume yet",
        ),
        (("psql", "orders", "--project", "demo", "-c", "select 1"), "NAME: orders is not running yet"),
        (("psql", "cache", "--project", "demo"), "NAME: cache is a redis database; psql opens PostgreSQL ones"),
    ]:
        done = cli("addons", *args)
        assert done.exit_code == 1, (args, done.output)
        assert expected in done.output and done.output.strip().count("\n") == 0, (args, done.output)
