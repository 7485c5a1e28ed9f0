"""One commit of a remote repository as a source tarball, with real ``git`` (docs/git.md).

``git fetch --depth 1 <url> <sha>`` into a temporary bare repository (a server that refuses to serve an
unadvertised commit is asked for the ref the event names instead, and the commit must then be there), then
``git archive --format=tar.gz <sha>``: the tree of exactly that commit, no ``.git``. A token goes in an
``Authorization`` header passed through git's environment (``GIT_CONFIG_*``), never on a command line, in the
URL or in a message.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile

from shared.errors import ZatteraError

SHA_RE = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
FETCH_TIMEOUT = 300.0


class FetchFailed(ZatteraError):
    """The commit could not be fetched or archived (the message is git's last line, without secrets)."""


def _scrub(text: str, secret: str) -> str:
    line = (text.strip().splitlines() or [""])[-1][:300]
    return line.replace(secret, "***") if secret else line


async def _git(args: list[str], env: dict[str, str], secret: str, timeout: float) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        "git", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise FetchFailed(f"git {args[0]} failed: {_scrub(err.decode(errors='replace'), secret)}")
    return out


async def archive_commit(
    url: str, sha: str, ref: str = "", *, auth_header: str = "", timeout: float = FETCH_TIMEOUT
) -> bytes:
    """The tar.gz of commit ``sha`` of the repository at ``url`` (``ref``: where it can be fetched from when
    the server serves only advertised commits)."""
    if not SHA_RE.match(sha):
        raise FetchFailed(f"{sha!r} is not a full commit id")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "GIT_CONFIG_NOSYSTEM": "1"})
    if auth_header:
        env.update(
            {
                "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": "http.extraHeader",
                "GIT_CONFIG_VALUE_0": f"Authorization: {auth_header}",
            }
        )
    with tempfile.TemporaryDirectory(prefix="zattera-git-") as tmp:
        await _git(["init", "-q", "--bare", tmp], env, auth_header, timeout)
        base = ["-C", tmp]
        try:
            await _git([*base, "fetch", "-q", "--no-tags", "--depth", "1", url, sha], env, auth_header, timeout)
        except FetchFailed:
            if not ref:
                raise
            await _git([*base, "fetch", "-q", "--no-tags", url, ref], env, auth_header, timeout)
        try:
            await _git([*base, "cat-file", "-e", f"{sha}^{{commit}}"], env, auth_header, timeout)
        except FetchFailed:
            raise FetchFailed(f"commit {sha[:12]} is not in {ref or 'the repository'}") from None
        return await _git(
            [*base, "-c", "core.bigFileThreshold=1m", "archive", "--format=tar.gz", sha], env, auth_header, timeout
        )
