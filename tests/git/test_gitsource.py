"""Git checkout and commit metadata with the real git binary (fast: local repositories in tmp_path)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shared.gitsource import GitError, branch_of, checkout, commit_info, head_commit, is_full_sha, redact


def _git(cwd: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "Ada",
        "GIT_AUTHOR_EMAIL": "ada@example.com",
        "GIT_COMMITTER_NAME": "Ada",
        "GIT_COMMITTER_EMAIL": "ada@example.com",
        "HOME": str(cwd),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def make_repo(root: Path) -> tuple[Path, str]:
    work = root / "work"
    work.mkdir()
    _git(work, "init", "-q", "-b", "main")
    (work / "app.py").write_text("print('hi')\n")
    (work / "sub").mkdir()
    (work / "sub" / "x.txt").write_text("x\n")
    _git(work, "add", ".")
    _git(work, "commit", "-q", "-m", "First commit\n\nWith a body.")
    return work, _git(work, "rev-parse", "HEAD").strip()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://user:tok@host/x.git failed", "https://***@host/x.git failed"),
        ("see http://a@b/c and https://d:e@f/g", "see http://***@b/c and https://***@f/g"),
        ("no url here", "no url here"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    ("ref", "branch"),
    [("refs/heads/main", "main"), ("refs/heads/feat/x", "feat/x"), ("refs/pull/3/head", "refs/pull/3/head")],
)
def test_branch_of(ref: str, branch: str) -> None:
    assert branch_of(ref) == branch


@pytest.mark.parametrize(
    ("value", "ok"), [("a" * 40, True), ("a" * 64, True), ("A" * 40, False), ("a" * 39, False), ("main", False)]
)
def test_is_full_sha(value: str, ok: bool) -> None:
    assert is_full_sha(value) is ok


async def test_checkout_local_and_metadata(tmp_path: Path) -> None:
    work, sha = make_repo(tmp_path)
    out = tmp_path / "out"
    assert await checkout(str(work), sha, out) == sha
    assert (out / "app.py").read_text() == "print('hi')\n"
    assert (out / "sub" / "x.txt").exists()
    assert not (out / ".git").exists()
    info = await commit_info(str(work), sha)
    assert info.author == "Ada <ada@example.com>"
    assert info.message == "First commit\n\nWith a body."
    head = head_commit(work)
    assert head is not None and head.sha == sha and head.branch == "main"
    assert head_commit(work / "sub") is None  # not the top of the checkout
    assert head_commit(tmp_path) is None


async def test_checkout_by_url_and_unknown_commit(tmp_path: Path) -> None:
    work, sha = make_repo(tmp_path)
    bare = tmp_path / "bare.git"
    _git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    out = tmp_path / "out"
    assert await checkout(f"file://{bare}", sha, out, ref="refs/heads/main") == sha
    assert (out / "app.py").exists()
    with pytest.raises(GitError, match="not found"):
        await checkout(str(bare), "b" * 40, tmp_path / "none")
