"""``deploy_commit`` (shared/actions/gitdeploy.py) on real NATS with the real git: the commit is checked
out, uploaded and deployed with its sha, ref, author and message on the release; a bad sha, an unknown
commit and a source naming another app are refused before anything is deployed."""

from __future__ import annotations

from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext
from shared.actions.gitdeploy import GitDeployFailed, deploy_commit
from shared.actions.refusals import Invalid
from shared.txn import Writer
from tests.actions.conftest import ENV_ID, PATH, named
from tests.git.test_gitsource import _git, make_repo


def _toml(work: Path, project: str, app: str) -> str:
    (work / "zattera.toml").write_text(f'project = "{project}"\napp = "{app}"\n[run]\ncommand = "python3 app.py"\n')
    _git(work, "add", ".")
    _git(work, "commit", "-q", "-m", f"name {project}/{app}")
    return _git(work, "rev-parse", "HEAD").strip()


async def test_a_commit_is_deployed_with_its_metadata(ctx: ActionContext, writer: Writer, tmp_path: Path) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    work, _ = make_repo(tmp_path)
    sha = _toml(work, "shop", "web")
    lines: list[str] = []
    done = await deploy_commit(
        ctx,
        project="shop",
        app="web",
        env="production",
        repo_path_or_url=str(work),
        commit_sha=sha,
        ref="refs/heads/main",
        author="",
        message="",
        progress=lines.append,
        wait=False,
    )
    assert (done.env_id, done.env, done.commit_sha, done.live, done.phase) == (ENV_ID, PATH, sha, False, "PENDING")
    release = ctx.view.release(done.release_id)
    assert release is not None
    source = release.source
    assert (source.git_sha, source.git_branch, source.git_ref) == (sha, "main", "refs/heads/main")
    assert (source.git_author, source.git_message) == ("Ada <ada@example.com>", "name shop/web")
    assert source.kind == pb.RELEASE_SOURCE_KIND_GIT and source.tarball_digest.startswith("sha256:")
    build = ctx.view.build(source.build_id)
    assert build is not None and build.git_sha == sha
    assert lines[0].startswith(f"checking out {sha[:12]} (main) for {PATH}")
    assert any(line.startswith("deployment ") for line in lines)


async def test_refusals_come_before_any_deploy(ctx: ActionContext, writer: Writer, tmp_path: Path) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    work, _ = make_repo(tmp_path)
    other = _toml(work, "shop", "admin")
    common = {"project": "shop", "app": "web", "env": "production", "repo_path_or_url": str(work)}
    args = {"ref": "refs/heads/main", "author": "", "message": "", "progress": lambda _: None, "wait": False}
    with pytest.raises(Invalid, match=r"^commit_sha: must be a full commit id"):
        await deploy_commit(ctx, **common, commit_sha="main", **args)  # type: ignore[arg-type]
    with pytest.raises(GitDeployFailed, match="not found in the repository"):
        await deploy_commit(ctx, **common, commit_sha="b" * 40, **args)  # type: ignore[arg-type]
    with pytest.raises(GitDeployFailed, match="names shop/admin, not shop/web"):
        await deploy_commit(ctx, **common, commit_sha=other, **args)  # type: ignore[arg-type]
    assert ctx.view.deployments(ENV_ID) == []
