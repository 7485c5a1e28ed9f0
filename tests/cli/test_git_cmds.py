"""The CLI side of git deploys on real NATS: ``zattera deploy DIR`` of a git checkout records its HEAD commit
(shown by ``releases``), and ``zattera git map|unmap|branches`` edit and list the branch map."""

from __future__ import annotations

import json
from pathlib import Path

from tests.git.test_gitsource import _git

SPEC = """project = "demo"
app = "hello"

[run]
command = "python3 app.py"

[env.production]
replicas = 1
"""


def test_deploy_of_a_checkout_records_its_head_commit(cli, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "zattera.toml").write_text(SPEC)
    (work / "app.py").write_text("print('hi')\n")
    _git(work, "init", "-q", "-b", "main")
    _git(work, "add", ".")
    _git(work, "commit", "-q", "-m", "Ship it\n\nbody")
    sha = _git(work, "rev-parse", "HEAD").strip()
    assert cli("apps", "apply", str(work / "zattera.toml")).exit_code == 0
    deployed = cli("deploy", str(work), "--no-watch")
    assert deployed.exit_code == 0, deployed.stderr
    assert f"commit {sha[:12]} (main): Ship it" in deployed.stderr
    releases = json.loads(cli("releases", "--env", "demo/hello/production", "--json").stdout)
    source = releases[0]["source"]
    assert (source["git_sha"], source["git_branch"], source["git_author"], source["git_message"]) == (
        sha,
        "main",
        "Ada <ada@example.com>",
        "Ship it\n\nbody",
    )
    table = cli("releases", "--env", "demo/hello/production").stdout
    assert sha[:12] in table and "Ship it" in table


def test_git_map_unmap_and_branches(cli, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    assert cli("apps", "apply", str(spec)).exit_code == 0
    mapped = cli("git", "map", "main", "--env", "demo/hello/production")
    assert mapped.exit_code == 0 and "branch main → demo/hello/production" in mapped.stderr
    assert json.loads(cli("git", "branches", "--json").stdout) == [{"env": "demo/hello/production", "branch": "main"}]
    bad = cli("git", "map", "a..b", "--env", "demo/hello/production")
    assert bad.exit_code == 1 and "BRANCH: 'a..b' is not a valid git branch name" in bad.stderr
    # apps apply without git_branch leaves the mapping; with it, sets it.
    assert cli("apps", "apply", str(spec)).exit_code == 0
    assert json.loads(cli("git", "branches", "--json").stdout)[0]["branch"] == "main"
    assert cli("git", "unmap", "--env", "demo/hello/production").exit_code == 0
    assert json.loads(cli("git", "branches", "--json").stdout) == []
    spec.write_text(SPEC + 'git_branch = "release"\n')
    assert cli("apps", "apply", str(spec)).exit_code == 0
    assert json.loads(cli("git", "branches", "--json").stdout)[0]["branch"] == "release"
    remote = cli("git", "remote", "--env", "demo/hello/production", "--url", "http://c.example:8090", "--user", "ci")
    assert remote.stdout.strip() == "http://ci@c.example:8090/git/demo/hello.git"
