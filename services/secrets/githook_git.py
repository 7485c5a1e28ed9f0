"""What the ``githooks`` loop does on the git host's side (docs/git.md, "Webhooks and previews"): fetch a
pushed commit (real ``git``, the sealed token as an HTTP header) into the sources store and deploy it
(:func:`git_commit_deployer`), and post a webhook-triggered deployment's state to the host's commit-status
API (:func:`post_commit_status`).
"""

import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from nats.js.errors import NotFoundError, ObjectNotFoundError
from zattera.v1 import types_pb2 as pb

from shared import githooks as G
from shared.connection import Connection
from shared.deploy import Deployer
from shared.deployments import is_terminal
from shared.gitfetch import archive_commit
from shared.subjects import SOURCES_STORE
from shared.txn import Writer

log = logging.getLogger(__name__)

STATUS_TIMEOUT = 10.0
"""Seconds one commit-status post may take."""


@dataclass(frozen=True)
class CommitRequest:
    """One commit to deploy: commit ``sha`` of ``repo_url`` (at ``ref``) to env ``env_id``.
    ``auth_header``: the ``Authorization`` value git must send ("" = none)."""

    env_id: str
    repo_url: str
    sha: str
    ref: str
    auth_header: str
    actor: str
    author: str
    message: str


CommitDeployer = Callable[[Writer, CommitRequest], Awaitable[str]]
"""Fetch and deploy a :class:`CommitRequest` through the writer; returns the deployment's id.

The integrator may put ``shared/actions/gitdeploy.py``'s ``deploy_commit`` (issue 37, items 2 and 5) behind
it::

    async def deploy(writer, c):
        git_env = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.extraHeader",
                   "GIT_CONFIG_VALUE_0": f"Authorization: {c.auth_header}"} if c.auth_header else None
        done = await deploy_commit(ActionContext(conn, writer, c.actor), project="", app="", env=c.env_id,
                                   repo_path_or_url=c.repo_url, commit_sha=c.sha, ref=c.ref, author=c.author,
                                   message=c.message, progress=lambda line: None, wait=False, git_env=git_env)
        return done.deployment_id
"""


def git_commit_deployer(conn: Connection) -> CommitDeployer:
    """The deployer of this module: ``git fetch`` + ``git archive`` → the sources store → a source deploy
    (a QUEUED build with the commit id, its release and deployment, in one fenced write)."""

    async def deploy(writer: Writer, c: CommitRequest) -> str:
        data = await archive_commit(c.repo_url, c.sha, c.ref, auth_header=c.auth_header)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        store = await conn.js.object_store(SOURCES_STORE)
        try:
            await store.get_info(digest)
        except (ObjectNotFoundError, NotFoundError):
            await store.put(digest, data)
        created = await Deployer(writer, created_by=c.actor).deploy_source(
            c.env_id,
            tarball_digest=digest,
            git_sha=c.sha,
            git_branch=c.ref.removeprefix("refs/heads/"),
            git_author=c.author,
            git_message=c.message,
            git_ref=c.ref,
        )
        return created.deployment.meta.id

    return deploy


_FINAL = {pb.DEPLOYMENT_PHASE_SUCCEEDED: "success"}


def commit_state(deployment: pb.Deployment | None) -> str:
    """pending | success | failure of a deployment (a missing one failed)."""
    if deployment is None:
        return "failure"
    if not is_terminal(deployment.phase):
        return "pending"
    return _FINAL.get(deployment.phase, "failure")


async def post_commit_status(
    hook: pb.GitHook,
    record: pb.GitDeploy,
    state: str,
    token: str,
    deployment: pb.Deployment | None,
    *,
    timeout: float = STATUS_TIMEOUT,
) -> bool:
    """Post ``state`` of ``record``'s commit to the git host; whether it was taken (a failure is logged)."""
    api = hook.api_url or G.default_api_url(hook.provider, hook.repo_url)
    target = f"{hook.console_url}/env/{record.environment_id}" if hook.console_url else ""
    description = {
        "pending": "deploying",
        "success": "deployed",
        "failure": (deployment.error if deployment is not None and deployment.error else "deploy failed"),
    }[state]
    request = G.status_request(hook.provider, api, record.repo, record.sha, state, token, target, description)
    try:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as session,
            session.post(request.url, json=request.body, headers=request.headers) as response,
        ):
            if response.status < 300:
                return True
            log.warning("git hook %s: commit status answered %d", hook.meta.id, response.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("git hook %s: commit status not posted: %s", hook.meta.id, type(exc).__name__)
    return False
