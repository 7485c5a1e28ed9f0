"""``git push`` over the console's smart HTTP (services/console/git.py) with the real git client against a
console on real NATS: basic auth with console users (wrong password 401, rate-limited 429, viewer 403), the
pre-receive hook's round trip refusing a branch mapped to no env with the mapped branches, and no password
in anything the pusher sees."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.console.git import GitService
from shared.connection import Connection
from shared.state.feed import StateView
from tests.console.rig import ADMIN_USER, LOGIN_FAILURES, PASSWORD, VIEWER_USER, Running
from tests.git.test_gitsource import make_repo


@pytest.fixture
async def git_console(
    console: Running, conn: Connection, view: StateView, tmp_path: Path
) -> AsyncIterator[tuple[Running, Path]]:
    service = GitService(tmp_path / "git", conn, view, console.console.actions, console.console.limiter, console.clock)
    await service.start()
    console.console.git = service
    work, _ = make_repo(tmp_path)
    try:
        yield console, work
    finally:
        await service.stop()


def _url(running: Running, user: str, password: str, repo: str = "shop/web") -> str:
    host = running.url.removeprefix("http://")
    return f"http://{user}:{password.replace(' ', '%20')}@{host}/git/{repo}.git"


async def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The git client, as an asyncio subprocess (the console serving it runs in this event loop)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd.parent), "GIT_TERMINAL_PROMPT": "0"}
    proc = await asyncio.create_subprocess_exec(
        "git", *args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def test_credentials_roles_and_the_rate_limit(git_console: tuple[Running, Path]) -> None:
    running, work = git_console
    ok = await _git(work, "ls-remote", _url(running, ADMIN_USER, PASSWORD))
    assert ok.returncode == 0, ok.stderr  # an empty repository, created on the first request
    viewer = await _git(work, "push", _url(running, VIEWER_USER, PASSWORD), "HEAD:refs/heads/main")
    assert viewer.returncode != 0 and "403" in viewer.stderr, viewer.stderr
    missing = await _git(work, "ls-remote", _url(running, ADMIN_USER, PASSWORD, "shop/nope"))
    assert missing.returncode != 0 and "remote: no app shop/nope" in missing.stderr, missing.stderr
    for _ in range(LOGIN_FAILURES):
        wrong = await _git(work, "ls-remote", _url(running, VIEWER_USER, "wrong password"))
        assert wrong.returncode != 0 and "Authentication failed" in wrong.stderr, wrong.stderr
        assert "wrong password" not in wrong.stderr.replace("wrong%20password", "")
    limited = await _git(work, "ls-remote", _url(running, VIEWER_USER, "wrong password"))
    assert limited.returncode != 0 and "429" in limited.stderr, limited.stderr


async def test_a_branch_mapped_to_no_env_is_refused_by_the_hook(git_console: tuple[Running, Path]) -> None:
    running, work = git_console
    pushed = await _git(work, "push", _url(running, ADMIN_USER, PASSWORD), "HEAD:refs/heads/main")
    assert pushed.returncode != 0
    assert "remote: zattera: refused: branch 'main' deploys to no env of shop/web; mapped branches: none" in (
        pushed.stderr
    ), pushed.stderr
    assert "pre-receive hook declined" in pushed.stderr
    assert PASSWORD not in pushed.stderr
    listed = await _git(work, "ls-remote", _url(running, ADMIN_USER, PASSWORD))
    assert listed.stdout == ""  # the refused push updated nothing
