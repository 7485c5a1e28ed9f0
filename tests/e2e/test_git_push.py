"""``git push`` to the console, end to end through ``zattera up`` (a subprocess) with the real git client:
a push deploys the pushed commit (build and deploy progress in the push's ``remote:`` lines) and the app
then serves it; a failing release command refuses the push, promotes nothing, and the old release still
answers; a branch mapped to no env and wrong credentials are refused."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.embedded import free_port
from tests.e2e.cluster import app_source, kill_tree_under, version_of
from tests.e2e.upcmd import Up, listen_port
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

ENV = "demo/hello/production"
HOST = "hello.localhost"
PASSWORD = "push-secret-0123"
# The release phase: fails unless the pushed source carries the file it checks (as a migration would fail
# on a schema it cannot apply), printing a line first so the output can be looked for.
RELEASE = (
    'release_command = "echo migrating; test -f migrate-ok || '
    "(echo 'migration 0002 failed: no such table' >&2; exit 3)\"\n"
    'git_branch = "main"\n'
)


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cwd.parent),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": "Grace Hopper",
        "GIT_AUTHOR_EMAIL": "grace@example.com",
        "GIT_COMMITTER_NAME": "Grace Hopper",
        "GIT_COMMITTER_EMAIL": "grace@example.com",
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, f"git {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


class Site:
    def __init__(self, up: Up, console_port: int, work: Path) -> None:
        self.up, self.console_port, self.work = up, console_port, work

    def remote(self, user: str = "admin", password: str = PASSWORD) -> str:
        return f"http://{user}:{password}@127.0.0.1:{self.console_port}/git/demo/hello.git"

    def commit(self, version: str, *, migrate_ok: bool, message: str) -> str:
        app_source(self.work, version)
        with open(self.work / "zattera.toml", "a") as fh:
            fh.write(RELEASE)
        marker = self.work / "migrate-ok"
        if migrate_ok:
            marker.write_text("yes\n")
        elif marker.exists():
            marker.unlink()
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "-m", message)
        return git(self.work, "rev-parse", "HEAD").stdout.strip()

    def push(self, ref: str = "main", **remote: str) -> subprocess.CompletedProcess[str]:
        return git(self.work, "push", self.remote(**remote), f"HEAD:refs/heads/{ref}", check=False)

    async def get(self) -> tuple[int, str]:
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                session.get(f"http://127.0.0.1:{self.up.proxy_port}/", headers={"Host": HOST}) as response,
            ):
                return response.status, await response.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return 0, repr(exc)

    async def serves(self, version: str) -> bool:
        status, body = await self.get()
        return status == 200 and version_of(body) == version


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("git-push")
    data_dir = root / "zattera-data"
    console_port = listen_port()
    up = Up(data_dir, free_port(), free_port(), env={"ZATTERA_CONSOLE_PORT": str(console_port)})
    try:
        import asyncio

        asyncio.run(eventually(lambda: "Press Ctrl-C to stop." in up.text(), 90, "zattera up is up"))
        work = root / "work"
        work.mkdir()
        git(work, "init", "-q", "-b", "main")
        s = Site(up, console_port, work)
        s.commit("v1", migrate_ok=True, message="first")
        up.cli("apps", "apply", str(work / "zattera.toml"))
        # The console creates its users bucket (and records its URL) once it runs.
        asyncio.run(
            eventually(lambda: up.cli("git", "remote", "--env", ENV, check=False).returncode == 0, 60, "the console")
        )
        up.cli("console", "add-user", "admin", "--role", "admin", stdin=PASSWORD + "\n")
        up.cli("console", "add-user", "watcher", "--role", "viewer", stdin=PASSWORD + "\n")
        yield s
    except BaseException:
        print(up.text())
        raise
    finally:
        up.kill()
        kill_tree_under(data_dir, also_matching=str(data_dir))


async def test_git_remote_prints_the_console_url(site: Site) -> None:
    async def recorded() -> bool:
        done = site.up.cli("git", "remote", "--env", ENV, "--user", "admin", check=False)
        return done.returncode == 0

    await eventually(recorded, 30, "the console recorded its URL")
    done = site.up.cli("git", "remote", "--env", ENV, "--user", "admin")
    assert done.stdout.strip() == f"http://admin@127.0.0.1:{site.console_port}/git/demo/hello.git"
    branches = json.loads(site.up.cli("git", "branches", "--json").stdout)
    assert branches == [{"env": ENV, "branch": "main"}]


async def test_a_push_deploys_the_commit_and_streams_its_progress(site: Site) -> None:
    sha = git(site.work, "rev-parse", "HEAD").stdout.strip()
    pushed = site.push()
    assert pushed.returncode == 0, pushed.stderr
    out = pushed.stderr
    assert f"remote: checking out {sha[:12]}" in out, out
    assert "remote: build> " in out, out  # the build's log, live
    assert "remote: release> migrating" in out, out  # the release command's output
    assert "RELEASING" in out and "remote: live: release v1 of demo/hello/production" in out, out
    assert PASSWORD not in out
    await eventually(lambda: site.serves("v1"), 60, "v1 answers through the proxy")
    releases = json.loads(site.up.cli("releases", "--env", ENV, "--json").stdout)
    source = releases[0]["source"]
    assert (source["git_sha"], source["git_author"], source["git_message"]) == (
        sha,
        "Grace Hopper <grace@example.com>",
        "first",
    ), releases[0]
    table = site.up.cli("releases", "--env", ENV).stdout
    assert sha[:12] in table and "Grace Hopper" in table
    status = json.loads(site.up.cli("status", "--env", ENV, "--json").stdout)
    assert status[0]["commit"]["sha"] == sha


async def test_a_failing_release_command_refuses_the_push_and_the_old_release_answers(site: Site) -> None:
    site.commit("v2", migrate_ok=False, message="break the schema")
    pushed = site.push()
    assert pushed.returncode != 0, pushed.stderr
    out = pushed.stderr
    assert "remote: release> migration 0002 failed: no such table" in out, out
    assert "release command failed (exit 3)" in out and "no such table" in out, out
    assert "pre-receive hook declined" in out, out
    assert await site.serves("v1"), await site.get()  # nothing promoted
    remote_head = git(site.work, "ls-remote", site.remote(), "refs/heads/main").stdout.split()[0]
    assert remote_head != git(site.work, "rev-parse", "HEAD").stdout.strip()  # the branch kept its commit
    deployments = json.loads(site.up.cli("deploy", "list", "--env", ENV, "--json").stdout)
    assert deployments[0]["phase"] == "DEPLOYMENT_PHASE_FAILED", deployments[0]
    # Fixed: the next push goes through.
    site.commit("v3", migrate_ok=True, message="fix the migration")
    pushed = site.push()
    assert pushed.returncode == 0, pushed.stderr
    await eventually(lambda: site.serves("v3"), 60, "v3 answers through the proxy")


async def test_a_branch_mapped_to_no_env_is_refused_with_the_mapped_branches(site: Site) -> None:
    pushed = site.push("feature-x")
    assert pushed.returncode != 0
    assert "branch 'feature-x' deploys to no env of demo/hello; mapped branches: main → production" in pushed.stderr


async def test_wrong_credentials_and_viewers_are_refused(site: Site) -> None:
    wrong = site.push(password="not-the-password")
    assert wrong.returncode != 0 and "Authentication failed" in wrong.stderr, wrong.stderr
    viewer = site.push(user="watcher")
    assert viewer.returncode != 0 and "403" in viewer.stderr, viewer.stderr
    assert await site.serves("v3")


async def test_zattera_deploy_of_the_checkout_shows_the_release_command_live(site: Site) -> None:
    sha = site.commit("v4", migrate_ok=True, message="deployed by hand")
    deployed = site.up.cli("deploy", str(site.work), "--env", ENV)
    assert "release> migrating" in deployed.stderr and "RELEASING" in deployed.stderr, deployed.stderr
    assert f"commit {sha[:12]} (main): deployed by hand" in deployed.stderr, deployed.stderr
    await eventually(lambda: site.serves("v4"), 60, "v4 answers through the proxy")
