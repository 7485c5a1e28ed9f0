"""``zattera backup create|list|verify`` and ``zattera restore`` as an operator runs them, against a real
nats-server and a directory target; the passphrase comes from the environment and is never printed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from shared.embedded import EmbeddedNats
from tests.backup.test_drill import ENV, PASSPHRASE, VALUE, cluster, populate, publish_key, quick_kdf
from tests.cli.rig import initialised_cli

__all__ = ["quick_kdf"]


def test_backup_commands_round_trip(
    nats_url: str, nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZATTERA_RECOVERY_PASSPHRASE", PASSPHRASE)
    old, new, target = tmp_path / "old", tmp_path / "new", str(tmp_path / "backups")
    zattera = initialised_cli(nats_url)

    async def setup(url: str, data: Path, *, full: bool) -> None:
        async with cluster(url, data) as c:
            await (populate(c) if full else publish_key(c))

    asyncio.run(setup(nats_url, old, full=True))
    created = zattera("backup", "create", "--to", target, "--data-dir", str(old), "--json")
    assert created.exit_code == 0, created.output
    backup_id = json.loads(created.stdout)["id"]
    listed = zattera("backup", "list", "--from", target, "--json")
    assert [b["id"] for b in json.loads(listed.stdout)] == [backup_id]
    verified = zattera("backup", "verify", "--from", target)
    assert verified.exit_code == 0 and "all intact" in verified.output

    refused = zattera("restore", "--from", target, "--data-dir", str(old))
    assert refused.exit_code == 1 and "the cluster is not empty" in refused.output

    asyncio.run(setup(nats_server.url, new, full=False))
    runner = CliRunner()
    restored = runner.invoke(app, ["--nats", nats_server.url, "restore", "--from", target, "--data-dir", str(new)])
    assert restored.exit_code == 0, restored.output
    assert (
        f"backup {backup_id} restored" in restored.output and "left out: 3 keys of the old machines" in restored.output
    )
    status = runner.invoke(app, ["--nats", nats_server.url, "status", "--json"])
    assert ENV in status.output
    for result in (created, listed, verified, refused, restored):
        assert PASSPHRASE not in result.output and VALUE not in result.output

    monkeypatch.setenv("ZATTERA_RECOVERY_PASSPHRASE", "a wrong passphrase")
    wrong = runner.invoke(
        app, ["--nats", nats_server.url, "restore", "--from", target, "--data-dir", str(new), "--force"]
    )
    assert wrong.exit_code == 1 and "the recovery passphrase does not open" in wrong.output
