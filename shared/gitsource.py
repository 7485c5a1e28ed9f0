"""Git for deploys (docs/git.md): a commit's tree checked out into a directory, and a commit's metadata, with
the real ``git`` binary (a subprocess per step; no library reimplements git's object store, transports and
hooks as faithfully as git itself).

* :func:`checkout` writes the files of ``sha`` from a local repository (bare or not; ``git archive``, so a
  pre-receive hook's quarantined objects are readable when its ``GIT_OBJECT_DIRECTORY`` /
  ``GIT_ALTERNATE_OBJECT_DIRECTORIES`` are passed in ``git_env``) or from a URL (a shallow fetch of the
  commit, else of the ref).
* :func:`commit_info` reads a commit's author and message; :func:`head_commit` a working tree's HEAD (what
  ``zattera deploy DIR`` records when DIR is a checkout).

Errors never carry a URL's credentials: :func:`redact` removes the userinfo of every URL in a message.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ZatteraError

_SHOW_FORMAT = "--format=%H%x00%an <%ae>%x00%B"
"""``git show -s``'s format for a commit's id, author and message (:func:`_shown_commit` reads it)."""
_SHA_RE = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
GIT_TIMEOUT = 300.0
"""One git step (a fetch of a large repository included) at most, in seconds."""
MAX_ARCHIVE_BYTES = 1024 * 1024 * 1024


class GitError(ZatteraError):
    """A git step failed (the message says which and git's own last words, credentials removed)."""


@dataclass(frozen=True, slots=True)
class CommitInfo:
    sha: str
    author: str
    """``Name <email>``."""
    message: str
    branch: str = ""


def redact(text: str) -> str:
    """``https://user:token@host/x`` → ``https://***@host/x``, everywhere in ``text``."""
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}***@", text)


def is_full_sha(value: str) -> bool:
    return bool(_SHA_RE.match(value))


_BAD_BRANCH = re.compile(r"(^[-/.]|[/.]$|\.\.|//|@\{|[\x00-\x20~^:?*\[\\\x7f]|\.lock$|/\.)")


def branch_problem(name: str) -> str:
    """Why ``name`` is not a branch name git accepts (``git check-ref-format --branch`` rules), "" if it is."""
    if not name:
        return "must not be empty"
    if len(name) > 200:
        return "must be at most 200 characters"
    if name == "@" or _BAD_BRANCH.search(name):
        return f"{name!r} is not a valid git branch name"
    return ""


def branch_of(ref: str) -> str:
    """``refs/heads/main`` → ``main``; another ref (a tag, a pull request's head) stays as given."""
    return ref.removeprefix("refs/heads/")


def _git_environ(git_env: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"})
    env.update(git_env or {})
    return env


async def git(*args: str, cwd: Path | None = None, git_env: Mapping[str, str] | None = None) -> bytes:
    """Run ``git ARGS``; its stdout, or :class:`GitError` with its last stderr line."""
    proc = await asyncio.create_subprocess_exec(
        "git",
        *args,
        cwd=cwd,
        env=_git_environ(git_env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, errs = await asyncio.wait_for(proc.communicate(), GIT_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise GitError(f"git {args[0]} took over {GIT_TIMEOUT:g}s") from None
    except asyncio.CancelledError:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if proc.returncode != 0:
        lines = [line for line in errs.decode(errors="replace").splitlines() if line.strip()]
        said = lines[-1] if lines else f"exit {proc.returncode}"
        raise GitError(redact(f"git {args[0]}: {said}"))
    return out


def _make_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


def is_local(repo: str) -> bool:
    """A repository path on this machine (not a URL, not ``user@host:path``)."""
    return "://" not in repo and not re.match(r"^[^/]+@[^/:]+:", repo) and Path(repo).exists()


async def checkout(
    repo: str, sha: str, destination: Path, *, ref: str = "", git_env: Mapping[str, str] | None = None
) -> str:
    """Write the tree of commit ``sha`` of ``repo`` (a local path or a URL) into ``destination`` (created
    empty); returns the full commit id. ``ref``: fetched instead when the server refuses a fetch by id.
    ``git_env``: added to git's environment (a hook's quarantine; for a URL, the fetch's credentials, e.g.
    ``GIT_SSH_COMMAND`` or ``GIT_CONFIG_COUNT``/``GIT_CONFIG_KEY_0=http.extraHeader``…)."""
    _make_dir(destination)
    if is_local(repo):
        try:
            full = await git("rev-parse", "--verify", "--quiet", f"{sha}^{{commit}}", cwd=Path(repo), git_env=git_env)
        except GitError:
            raise GitError(f"commit {sha[:12]} not found in the repository") from None
        full_sha = full.decode().strip()
        data = await git("archive", "--format=tar", full_sha, cwd=Path(repo), git_env=git_env)
    else:
        clone = destination.parent / (destination.name + ".git")
        await git("init", "--quiet", "--bare", str(clone))
        try:
            await git("fetch", "--quiet", "--no-tags", "--depth=1", repo, sha, cwd=clone, git_env=git_env)
        except GitError:
            if not ref:
                raise
            await git("fetch", "--quiet", "--no-tags", repo, ref, cwd=clone, git_env=git_env)
        full_sha = (await git("rev-parse", "--verify", f"{sha}^{{commit}}", cwd=clone)).decode().strip()
        data = await git("archive", "--format=tar", full_sha, cwd=clone)
    if len(data) > MAX_ARCHIVE_BYTES:
        raise GitError(f"commit {full_sha[:12]}: its tree is {len(data):,} bytes, over {MAX_ARCHIVE_BYTES:,}")
    await asyncio.to_thread(_extract, data, destination)
    return full_sha


def _extract(data: bytes, destination: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(destination, filter="data")


async def commit_info(repo: str, sha: str, *, git_env: Mapping[str, str] | None = None) -> CommitInfo:
    """Author and message of ``sha`` in a local repository."""
    out = await git("show", "-s", _SHOW_FORMAT, sha, cwd=Path(repo), git_env=git_env)
    return _shown_commit(out)


def _shown_commit(out: bytes, branch: str = "") -> CommitInfo:
    """The commit ``git show -s _SHOW_FORMAT`` printed."""
    full, author, message = out.decode(errors="replace").split("\x00", 2)
    return CommitInfo(full.strip(), author.strip(), message.strip(), branch)


def _git_in(directory: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``git ARGS`` in ``directory`` and wait for it (at most 10 s), whatever its exit status."""
    return subprocess.run(["git", *args], cwd=directory, env=_git_environ(None), capture_output=True, timeout=10)


def head_commit(directory: Path) -> CommitInfo | None:
    """HEAD of the git working tree ``directory`` is the top of (None: not a checkout, no commit, or no
    git), with its branch ("" when detached). Uncommitted changes are not looked at: the source deployed is
    the directory as it is, the commit says what it was based on."""
    try:
        top = _git_in(directory, "rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.decode().strip()).resolve() != directory.resolve():
            return None
        shown = _git_in(directory, "show", "-s", _SHOW_FORMAT, "HEAD")
        if shown.returncode != 0:
            return None
        branch = _git_in(directory, "symbolic-ref", "--quiet", "--short", "HEAD")
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = branch.stdout.decode().strip() if branch.returncode == 0 else ""
    return _shown_commit(shown.stdout, name)
