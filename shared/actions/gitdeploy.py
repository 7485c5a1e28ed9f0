"""Deploying one git commit (``git push`` to the console's remote, a webhook; docs/git.md): the commit's tree
checked out with the real ``git`` into a temporary directory, checked as ``zattera deploy DIR`` checks a
source, packed, uploaded and deployed through :func:`shared.actions.deploys.deploy` with the commit's sha,
ref, author and message recorded on the release; then followed, its progress handed line by line to the
caller, until it is live or has failed."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.actions.context import ActionContext
from shared.actions.deploys import Deploy, GitCommit, deploy
from shared.actions.fields import EnvPath
from shared.actions.names import env_path, target_env
from shared.actions.refusals import Invalid
from shared.deploysource import SourceRefused, inspect_source, mismatch
from shared.deploywatch import LIVE_PHASES, Progress, follow_deployment, phase_name
from shared.errors import ZatteraError
from shared.gitsource import GitError, branch_of, checkout, commit_info, is_full_sha, is_local, redact
from shared.sourcepack import pack, upload

__all__ = ["CommitDeployed", "GitDeployFailed", "Progress", "deploy_commit"]


class GitDeployFailed(ZatteraError):
    """The commit could not be deployed before a deployment existed (checkout, source checks, upload); the
    message says why. Refusals of the deploy itself are the deploy action's (:class:`shared.deploy.DeployError`)."""


@dataclass(frozen=True, slots=True)
class CommitDeployed:
    """What became of a commit's deploy. ``live``: promoted (the new release takes the traffic)."""

    deployment_id: str
    release_id: str
    release_version: int
    env_id: str
    env: EnvPath
    commit_sha: str
    live: bool
    phase: str
    """The deployment's phase when the follow ended (``PENDING`` when not waited for)."""
    error: str = ""
    """Why it failed (with the release command's last lines when that is what failed)."""


def _target(project: str, app: str, env: str) -> str:
    if project and app:
        return f"{project}/{app}/{env}"
    return env


async def deploy_commit(
    ctx: ActionContext,
    *,
    project: str,
    app: str,
    env: str,
    repo_path_or_url: str,
    commit_sha: str,
    ref: str,
    author: str,
    message: str,
    progress: Progress,
    wait: bool = True,
    timeout: float | None = None,
    git_env: Mapping[str, str] | None = None,
) -> CommitDeployed:
    """Deploy commit ``commit_sha`` of ``repo_path_or_url`` to env ``project/app/env`` (``project`` and
    ``app`` "" : ``env`` is an env id or path).

    ``ref``: the pushed ref (``refs/heads/main``; recorded, and fetched when the server refuses a fetch by
    id); ``author`` (``Name <email>``) and ``message`` "" are read from the repository when it is local.
    ``progress`` gets each line of progress: checkout, upload, then (with ``wait``) the deployment's
    phases, build log and release command output until it is live or failed, at most ``timeout``
    seconds. ``git_env``: extra environment for git (a pre-receive hook's quarantine variables).

    Raises :class:`GitDeployFailed` before a deployment exists (bad sha, checkout, source refused, a
    zattera.toml naming another app) and the deploy action's refusals (a deployment already in progress…);
    a deployment that fails is returned with ``live`` False and its ``error``."""
    if not is_full_sha(commit_sha):
        raise Invalid("commit_sha", "must be a full commit id (40 or 64 lowercase hex digits)")
    target = target_env(ctx.view, _target(project, app, env))
    where = env_path(ctx.view, target)
    scratch = Path(tempfile.mkdtemp(prefix="zattera-git-"))
    try:
        source = scratch / "src"
        progress(f"checking out {commit_sha[:12]} ({branch_of(ref) or 'no ref'}) for {where}")
        try:
            full_sha = await checkout(repo_path_or_url, commit_sha, source, ref=ref, git_env=git_env)
            if (not author or not message) and is_local(repo_path_or_url):
                info = await commit_info(repo_path_or_url, full_sha, git_env=git_env)
                author, message = author or info.author, message or info.message
        except GitError as exc:
            raise GitDeployFailed(str(exc)) from None
        try:
            manifest, _ = await asyncio.to_thread(inspect_source, source)
        except SourceRefused as exc:
            raise GitDeployFailed(str(exc).replace(str(source), f"commit {full_sha[:12]}")) from None
        if problem := mismatch(manifest, where, where):
            raise GitDeployFailed(problem.replace(str(source), f"commit {full_sha[:12]}").split(". Deploy it")[0])
        try:
            data = await asyncio.to_thread(pack, source)
        except ValueError as exc:
            raise GitDeployFailed(str(exc)) from None
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    digest = await upload(ctx.conn, data)
    progress(f"uploaded source {digest[:19]}… ({len(data):,} bytes)")
    commit = GitCommit(full_sha, branch=branch_of(ref), ref=ref, author=author, message=message)
    done = await deploy(ctx, Deploy(target.meta.id, tarball_digest=digest, commit=commit))
    progress(f"deployment {done.deployment_id} created: release v{done.release_version} of {done.env}")
    result = CommitDeployed(
        done.deployment_id, done.release_id, done.release_version, done.env_id, done.env, full_sha, False, "PENDING"
    )
    if not wait:
        return result
    d = await follow_deployment(ctx.conn, ctx.view, done.deployment_id, progress, timeout=timeout)
    if d is None:
        return dataclasses.replace(result, live=False, phase="GONE", error="the deployment vanished")
    live = d.phase in LIVE_PHASES
    error = "" if live else (d.error or f"still {phase_name(d.phase)} after {timeout}s")
    if live:
        progress(f"live: release v{done.release_version} of {done.env} ({full_sha[:12]})")
    else:
        progress(f"deployment {phase_name(d.phase).lower()}: {error}")
    return dataclasses.replace(result, live=live, phase=phase_name(d.phase), error=redact(error))
