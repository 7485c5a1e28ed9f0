"""``zattera notify add|list|test|remove`` as an operator runs them against a real nats-server: the URL's
token and the signing secret never shown but once (the secret, by ``add``), bad input naming the option,
``test`` exiting 1 when nothing delivers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.backup.test_drill import cluster, publish_key
from tests.cli.rig import initialised_cli

TOKEN = "xoxb-T0K3N-never-shown"


def test_notify_commands_round_trip(nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zattera = initialised_cli(nats_url)

    async def setup() -> None:
        async with cluster(nats_url, tmp_path) as c:
            await publish_key(c)

    asyncio.run(setup())
    monkeypatch.setenv("ZATTERA_NOTIFY_URL", f"https://hooks.slack.com/services/{TOKEN}")
    added = zattera("notify", "add", "ops", "--format", "slack", "--events", "deploy.failed,node.*")
    assert added.exit_code == 0, added.output
    secret = added.stdout.strip()
    assert len(secret) >= 40 and "channel ops added: slack to https://hooks.slack.com/…" in added.output
    listed = zattera("notify", "list", "--json")
    assert listed.exit_code == 0, listed.output
    [channel] = json.loads(listed.stdout)
    assert channel["name"] == "ops" and channel["events"] == ["deploy.failed", "node.*"]
    assert channel["url"] == "https://hooks.slack.com/…" and not channel["failing"]
    table = zattera("notify", "list")
    assert "ops" in table.output and "slack" in table.output
    for result in (listed, table):
        assert TOKEN not in result.output and secret not in result.output

    bad = zattera("notify", "add", "ops2", "--format", "teams")
    assert bad.exit_code != 0 and "--format: 'teams' is not one of generic, slack, discord" in bad.output
    monkeypatch.delenv("ZATTERA_NOTIFY_URL")
    missing = zattera("notify", "add", "ops2")
    assert missing.exit_code != 0 and "--url" in missing.output

    undelivered = zattera("notify", "test", "ops", "--wait", "1")  # no control plane delivers here
    assert undelivered.exit_code == 1 and "not delivered: no delivery within 1s" in undelivered.output
    removed = zattera("notify", "remove", "ops")
    assert removed.exit_code == 0 and "channel ops removed" in removed.output
    gone = zattera("notify", "remove", "ops")
    assert gone.exit_code != 0 and "no notification channel 'ops'" in gone.output
