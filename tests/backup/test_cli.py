"""``zattera backup create|list|verify`` and ``zattera restore`` as an operator runs them, against a real
nats-server and a directory target; the passphrase comes from the environment and is never printed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner
from zattera.v1 import types_pb2 as pb

from cli.main import app
from shared.backup.status import SCHEDULE_ID
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

    # A truncated object: named by `backup verify` and by `restore`, which writes nothing (exit 1 both).
    monkeypatch.setenv("ZATTERA_RECOVERY_PASSPHRASE", PASSPHRASE)
    manifest = json.loads((Path(target) / "backups" / backup_id / "manifest.json").read_text())
    entry = next(e for e in manifest["entries"] if e["kind"] == "sources")
    blob = Path(target) / "blobs" / entry["sha256"]
    blob.write_bytes(blob.read_bytes()[:10])
    problem = f"object sources/{entry['name']} is 10 bytes, expected {entry['size']} (truncated?)"
    broken = zattera("backup", "verify", "--from", target)
    assert broken.exit_code == 1 and problem in broken.output, broken.output
    refused = runner.invoke(
        app, ["--nats", nats_server.url, "restore", "--from", target, "--data-dir", str(new), "--force"]
    )
    assert refused.exit_code == 1 and problem in refused.output, refused.output


def test_backup_schedule_status_and_a_failure_shown_by_zattera_status(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZATTERA_RECOVERY_PASSPHRASE", PASSPHRASE)
    zattera = initialised_cli(nats_url)

    async def setup() -> None:
        async with cluster(nats_url, tmp_path / "data") as c:
            await populate(c)

    asyncio.run(setup())
    target = str(tmp_path / "backups")
    bad = zattera("backup", "schedule", "every night", "--to", target)
    assert bad.exit_code == 1 and "schedule" in bad.output
    scheduled = zattera("backup", "schedule", "0 3 * * *", "--to", target, "--keep", "7")
    assert scheduled.exit_code == 0, scheduled.output
    assert "backups scheduled: 0 3 * * * to " in scheduled.output and PASSPHRASE not in scheduled.output
    shown = zattera("backup", "status", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["keep"] == 7
    quiet = zattera("status")
    assert "backups:" not in quiet.output, "a healthy schedule does not clutter `zattera status`"

    async def fail() -> None:
        async with cluster(nats_url, tmp_path / "data") as c:
            run = pb.BackupRun(ok=False, error="/x: cannot create the directory: File exists", failures=1)
            run.meta.id = SCHEDULE_ID
            run.started_at.FromSeconds(1_700_000_000)
            await c.ctx.writer.commit(c.ctx.writer.txn().put(run))

    asyncio.run(fail())
    failing = zattera("status")
    assert "backups: FAILING since 2023-11-14 22:13:20 UTC (1 run(s) in a row): /x: cannot create" in failing.output
    assert zattera("backup", "status").exit_code == 1

    assert zattera("backup", "unschedule").exit_code == 0
    assert not json.loads(zattera("backup", "status", "--json").stdout)["scheduled"]
