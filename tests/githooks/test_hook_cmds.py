"""``zattera git hook add|list|remove`` as an operator runs them against a real nats-server: the endpoint URL
and the secret printed once, the token (read from a file) never shown, bad input naming the option."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.backup.test_drill import cluster
from tests.cli.rig import initialised_cli
from tests.githooks.rig import ENV_ID, TOKEN, seed


def test_git_hook_commands_round_trip(nats_url: str, tmp_path: Path) -> None:
    zattera = initialised_cli(nats_url)

    async def setup() -> None:
        async with cluster(nats_url, tmp_path) as c:
            await seed(c.conn, c.view)

    asyncio.run(setup())
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    repo = "https://git.example.com/octo/app.git"
    added = zattera(
        "git", "hook", "add", "--env", "shop/web/production", "--provider", "gitlab", "--repo", repo,
        "--token-file", str(token), "--previews", "--preview-label", "preview", "--preview-ttl", "72h",
        "--share-secret", "DB_URL", "--console-url", "https://console.example.com",
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    secret = added.stdout.strip()
    assert len(secret) >= 40
    assert "endpoint: https://console.example.com/hooks/gitlab/" in added.output, added.output
    listed = zattera("git", "hook", "list", "--json")
    assert listed.exit_code == 0, listed.output
    [hook] = json.loads(listed.stdout)
    assert hook["env"] == "shop/web/production" and hook["provider"] == "gitlab" and hook["has_token"]
    assert hook["preview_label"] == "preview" and hook["preview_ttl"] == 72 * 3600
    assert hook["shared_secrets"] == ["DB_URL"] and hook["previews_live"] == []
    table = zattera("git", "hook", "list")
    assert hook["id"] in table.output
    for result in (added, listed, table):
        assert TOKEN not in result.output
    for result in (listed, table):
        assert secret not in result.output

    bad = zattera("git", "hook", "add", "--env", ENV_ID, "--provider", "bitbucket", "--repo", repo)
    assert bad.exit_code != 0 and "--provider: 'bitbucket' is not one of github, gitlab, gitea" in bad.output
    creds = zattera("git", "hook", "add", "--env", ENV_ID, "--provider", "github", "--repo", "https://u:p@h/x.git")
    assert creds.exit_code != 0 and "--repo" in creds.output and "u:p" not in creds.output.replace("--repo", "")
    ttl = zattera("git", "hook", "add", "--env", ENV_ID, "--provider", "github", "--repo", repo, "--preview-ttl", "x")
    assert ttl.exit_code != 0 and "--preview-ttl 'x'" in ttl.output
    missing = zattera(
        "git", "hook", "add", "--env", ENV_ID, "--provider", "github", "--repo", repo, "--token-file", "/nope"
    )
    assert missing.exit_code != 0 and "--token-file /nope" in missing.output
    removed = zattera("git", "hook", "remove", hook["id"])
    assert removed.exit_code == 0 and f"hook {hook['id']} removed" in removed.output
    gone = zattera("git", "hook", "remove", hook["id"])
    assert gone.exit_code != 0 and "no git hook" in gone.output
