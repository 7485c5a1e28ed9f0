"""Webhooks from git hosts, the control side (docs/git.md, "Webhooks and previews").

* :class:`HookGate` (every secrets replica, queue group): answers the console's
  ``zattera.githooks.deliver`` requests. It opens the hook's sealed secret (only this service holds the
  key), verifies the delivery (:func:`shared.githooks.verify`), and publishes it to the
  ``ZATTERA_GITHOOKS`` stream with ``Nats-Msg-Id`` = ``<hook>:<delivery id>``: JetStream refuses a second
  one within the duplicate window, so a replayed delivery is answered 409 and nothing more happens. The
  console answers the git host at once (202): no git, no build on the request's path.
* :class:`GitHooks` (the leader of ``lease.githooks``): consumes the stream, one delivery at a time. A push
  to the hook's branch fetches that commit (real ``git``, the sealed token as an HTTP header) and deploys
  it to the hook's env; a pull request against it creates, refreshes or deletes preview env ``pr-<n>``
  (shared/actions/githooks.py) and deploys its head there. Each pass reports webhook-triggered
  deployments' states to the git host's commit-status API (``gitdeploy.<deployment>`` records) and
  deletes previews whose TTL passed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from nacl.exceptions import CryptoError
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError, ObjectNotFoundError
from zattera.v1 import types_pb2 as pb

from shared import githooks as G
from shared import keys as K
from shared.actions.githooks import expired_previews, find_preview, plan_preview, plan_preview_removal
from shared.backoff import Backoff
from shared.clock import wait_or_timer
from shared.connection import Connection
from shared.deploy import Deployer, FailedPrecondition, blocking_deployments
from shared.deployments import is_terminal
from shared.events import WARNING, make_event
from shared.gitfetch import archive_commit
from shared.loop import LeaderLoop, LoopDeps
from shared.provisioning import recorded_config
from shared.retry import Attempt, commit_with_retry
from shared.secrets import SECRETS_QUEUE, Keyring, unseal
from shared.subjects import GITHOOKS_DELIVER_SUBJECT, GITHOOKS_DELIVERY_PREFIX, GITHOOKS_STREAM, SOURCES_STORE
from shared.txn import Writer

log = logging.getLogger(__name__)

DUPLICATE_WINDOW = 24 * 3600.0
"""Seconds a delivery id is remembered: a replay within it is refused (JetStream's dedupe window)."""
MAX_DELIVERIES = 10_000
"""The stream keeps at most this many deliveries (and each at most the duplicate window): bounded."""
CONSUMER = "githooks"
ACK_WAIT = 300.0
STATUS_TIMEOUT = 10.0

HOOK_HEADER = "Zattera-Hook"
PROVIDER_HEADER = "Zattera-Provider"


def stream_config(replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=GITHOOKS_STREAM,
        subjects=[GITHOOKS_DELIVERY_PREFIX + ">"],
        duplicate_window=DUPLICATE_WINDOW,
        max_age=DUPLICATE_WINDOW,
        max_msgs=MAX_DELIVERIES,
        max_msg_size=G.MAX_BODY + 16 * 1024,
        num_replicas=replicas,
    )


async def ensure_stream(conn: Connection, replicas: int = 0) -> None:
    """Create the deliveries stream unless it exists (the secrets service does at start), with the cluster's
    recorded stream replicas (``replicas`` 0)."""
    try:
        await conn.js.stream_info(GITHOOKS_STREAM)
    except NotFoundError:
        if not replicas:
            recorded = await recorded_config(conn.js)
            replicas = recorded.replicas if recorded is not None else 1
        await conn.js.add_stream(stream_config(replicas))


def open_hook(keyring: Keyring | None, hook: pb.GitHook) -> dict[str, str]:
    """The hook's ``secret`` and ``token`` ({} when the key is not held or does not open them)."""
    key = keyring.by_id(hook.key_id) if keyring is not None else None
    if key is None or not hook.sealed:
        return {}
    try:
        opened = json.loads(unseal(key, hook.sealed))
    except (CryptoError, ValueError):
        return {}
    return {str(k): str(v) for k, v in opened.items()} if isinstance(opened, dict) else {}


def _answer(status: int, message: str) -> bytes:
    return json.dumps({"status": status, "message": message}).encode()


class HookGate:
    """Verifies deliveries and queues the genuine, unseen ones (any secrets replica)."""

    def __init__(
        self, conn: Connection, view_get: Callable[[str], pb.GitHook | None], keyring: Callable[[], Keyring | None]
    ) -> None:
        self._conn = conn
        self._hook = view_get
        self._keyring = keyring
        self._sub: Subscription | None = None

    async def start(self, replicas: int = 0) -> None:
        """Create the stream when missing and answer deliveries from now on."""
        await ensure_stream(self._conn, replicas)
        self._sub = await self._conn.nc.subscribe(GITHOOKS_DELIVER_SUBJECT, queue=SECRETS_QUEUE, cb=self._on_delivery)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def serve(self, replicas: int = 0) -> None:
        await self.start(replicas)
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def _on_delivery(self, msg: Msg) -> None:
        try:
            status, message = await self.admit(dict(msg.headers or {}), msg.data)
        except Exception:
            log.exception("git hook delivery")
            status, message = 503, "the delivery could not be queued; the git host may redeliver it"
        if msg.reply:
            await msg.respond(_answer(status, message))

    async def admit(self, headers: dict[str, str], body: bytes) -> tuple[int, str]:
        """(HTTP status, message) for one delivery: 202 queued, 401 unsigned or forged, 404 no such hook,
        409 replayed, 503 the key is not held."""
        hook_id, provider = headers.get(HOOK_HEADER, ""), headers.get(PROVIDER_HEADER, "")
        hook = self._hook(hook_id) if hook_id else None
        if hook is None or hook.provider != provider:
            return 404, "no such hook"
        opened = open_hook(self._keyring(), hook)
        if "secret" not in opened:
            return 503, "the secrets service cannot open this hook's secret (see docs/secrets.md)"
        try:
            G.verify(provider, opened["secret"], headers, body)
            delivery = G.delivery_id(provider, headers)
        except G.DeliveryRefused as refused:
            return refused.status, refused.message
        event_name = headers.get(G.HEADERS[provider].event, "")
        ack = await self._conn.js.publish(
            GITHOOKS_DELIVERY_PREFIX + hook_id,
            body,
            stream=GITHOOKS_STREAM,
            headers={"Nats-Msg-Id": f"{hook_id}:{delivery}", "Zattera-Event": event_name, HOOK_HEADER: hook_id},
        )
        if ack.duplicate:
            return 409, f"refused: delivery {delivery} was received before (a replay)"
        return 202, f"queued delivery {delivery}"


class CommitDeployer(Protocol):
    """Fetch commit ``sha`` of ``repo_url`` and deploy it to env ``env_id`` through ``writer``; returns the
    deployment's id. ``auth_header``: the ``Authorization`` value git must send ("" = none).

    The integrator may put ``shared/actions/gitdeploy.py``'s ``deploy_commit`` (issue 37, items 2 and 5) behind
    it::

        async def deploy(writer, *, env_id, repo_url, sha, ref, auth_header, actor, author, message):
            git_env = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.extraHeader",
                       "GIT_CONFIG_VALUE_0": f"Authorization: {auth_header}"} if auth_header else None
            done = await deploy_commit(ActionContext(conn, writer, actor), project="", app="", env=env_id,
                                       repo_path_or_url=repo_url, commit_sha=sha, ref=ref, author=author,
                                       message=message, progress=lambda line: None, wait=False, git_env=git_env)
            return done.deployment_id
    """

    def __call__(
        self,
        writer: Writer,
        *,
        env_id: str,
        repo_url: str,
        sha: str,
        ref: str,
        auth_header: str,
        actor: str,
        author: str,
        message: str,
    ) -> Awaitable[str]: ...


def git_commit_deployer(conn: Connection) -> CommitDeployer:
    """The deployer of this module: ``git fetch`` + ``git archive`` → the sources store → a source deploy
    (a QUEUED build with the commit id, its release and deployment, in one fenced write)."""

    async def deploy(
        writer: Writer,
        *,
        env_id: str,
        repo_url: str,
        sha: str,
        ref: str,
        auth_header: str,
        actor: str,
        author: str,
        message: str,
    ) -> str:
        data = await archive_commit(repo_url, sha, ref, auth_header=auth_header)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        store = await conn.js.object_store(SOURCES_STORE)
        try:
            await store.get_info(digest)
        except (ObjectNotFoundError, NotFoundError):
            await store.put(digest, data)
        branch = ref.removeprefix("refs/heads/")
        created = await Deployer(writer, created_by=actor).deploy_source(
            env_id,
            tarball_digest=digest,
            git_sha=sha,
            git_branch=branch,
            git_author=author,
            git_message=message,
            git_ref=ref,
        )
        return created.deployment.meta.id

    return deploy


@dataclass(frozen=True)
class GitHooksSettings:
    domain: str = ""
    """The cluster's app domain: previews are ``pr-<n>.<app>.<domain>`` ("" = ``localhost``)."""
    status_timeout: float = STATUS_TIMEOUT
    fetch_wait: float = 1.0
    """Seconds one pull of the stream waits for a delivery."""
    supersede_wait: float = 120.0
    """Seconds a push waits for the deployments it superseded (canceled) to end before deploying."""


_FINAL = {pb.DEPLOYMENT_PHASE_SUCCEEDED: "success"}


def commit_state(deployment: pb.Deployment | None) -> str:
    """pending | success | failure of a deployment (a missing one failed)."""
    if deployment is None:
        return "failure"
    if not is_terminal(deployment.phase):
        return "pending"
    return _FINAL.get(deployment.phase, "failure")


class GitHooks(LeaderLoop):
    name = "githooks"
    kinds = frozenset({K.DEPLOYMENT, K.GIT_DEPLOY, K.ENV, K.GIT_HOOK})

    def __init__(
        self,
        deps: LoopDeps,
        keyring: Callable[[], Keyring | None],
        *,
        settings: GitHooksSettings | None = None,
        deployer: CommitDeployer | None = None,
        tick: float = 15.0,
    ) -> None:
        super().__init__(deps, tick=tick)
        self._keyring = keyring
        self.settings = settings or GitHooksSettings()
        self._deploy = deployer or git_commit_deployer(deps.conn)
        self._consumer: asyncio.Task[None] | None = None
        self.handled = 0
        """Deliveries handled (tests wait on it)."""

    # ------------------------------------------------------------------ the term

    async def begin_term(self) -> None:
        await ensure_stream(self.conn)
        self._consumer = asyncio.create_task(self._consume(), name="githooks-consumer")

    async def end_term(self) -> None:
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)
            self._consumer = None

    def seconds_until_due(self) -> float | None:
        now = self.clock.now()
        due = [
            e.preview_expires_at.ToNanoseconds() / 1e9 - now
            for e in self.view.envs()
            if e.type == pb.ENVIRONMENT_TYPE_PREVIEW and e.HasField("preview_expires_at")
        ]
        return max(min(due), 0.0) if due else None

    async def _consume(self) -> None:
        """Take deliveries one at a time for the whole term; a lost consumer (the connection, the stream) is
        opened again after a backoff, what was not acknowledged comes again."""
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                sub = await self.conn.js.pull_subscribe(
                    GITHOOKS_DELIVERY_PREFIX + ">",
                    durable=CONSUMER,
                    stream=GITHOOKS_STREAM,
                    config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT, max_ack_pending=1),
                )
                while True:
                    try:
                        msgs = await sub.fetch(1, timeout=self.settings.fetch_wait)
                    except NatsTimeout:
                        continue
                    for msg in msgs:
                        await self.handle(msg.headers or {}, msg.subject, msg.data)
                        await msg.ack()
                        backoff.reset()
            except Exception as exc:
                log.warning("git hooks: the deliveries consumer failed (%s); opening it again", exc)
                await self.clock.sleep(next(backoff))

    # ------------------------------------------------------------------ deliveries

    async def handle(self, headers: dict[str, str], subject: str, body: bytes) -> None:
        """Act on one verified delivery; what fails is announced (``git.failed``), never retried."""
        hook_id = subject.removeprefix(GITHOOKS_DELIVERY_PREFIX)
        hook = self.view.get(K.GIT_HOOK, hook_id)
        try:
            if not isinstance(hook, pb.GitHook):
                return  # removed since
            event = G.parse(hook.provider, headers.get("Zattera-Event", ""), body)
            if event.kind == "push":
                await self._on_push(hook, event)
            elif event.kind == "pull_request":
                await self._on_pull_request(hook, event)
        except Exception as exc:
            log.warning("git hook %s: %s", hook_id, exc)
            await self.events.publish(
                make_event("git.failed", f"git hook {hook_id}: {exc}", severity=WARNING, fields={"hook": hook_id})
            )
        finally:
            self.handled += 1

    def _auth(self, hook: pb.GitHook) -> tuple[str, str]:
        token = open_hook(self._keyring(), hook).get("token", "") if hook.has_token else ""
        return (G.fetch_auth_header(hook.provider, token) if token else ""), token

    async def _on_push(self, hook: pb.GitHook, event: G.Event) -> None:
        if event.branch != hook.branch or event.deleted:
            return
        await self._deploy_to(hook, hook.environment_id, event)

    async def _on_pull_request(self, hook: pb.GitHook, event: G.Event) -> None:
        if event.branch != hook.branch or not hook.previews:
            return
        base = self.view.env(hook.environment_id)
        if base is None:
            return
        existing = find_preview(self.view, base, event.number)
        if event.action == "closed":
            if existing is not None and existing.type == pb.ENVIRONMENT_TYPE_PREVIEW:
                await self._remove_preview(hook, existing, "closed")
            return
        if event.action not in ("opened", "reopened", "synchronize", "labeled"):
            return
        if not G.wants_preview(hook.previews, hook.preview_label, event):
            return
        if event.action == "labeled" and existing is not None:
            return  # already previewed: a label changes nothing else
        assert self.writer is not None
        writer = self.writer
        domain = self.settings.domain or "localhost"

        def decide() -> Attempt[pb.Environment]:
            plan = plan_preview(self.view, writer, hook, event, domain=domain, now=self.clock.now())
            return Attempt(plan.txn, plan.env)

        env = await commit_with_retry(writer, decide, clock=self.clock, contended=f"preview pr-{event.number}")
        if existing is None:
            app = self.view.app(env.app_id)
            hostname = G.preview_hostname(event.number, app.name if app else "app", domain)
            await self.events.publish(
                make_event(
                    "preview.created",
                    f"pull request #{event.number} has preview env {env.name} at {hostname}",
                    project_id=env.project_id,
                    app_id=env.app_id,
                    environment_id=env.meta.id,
                    fields={"hook": hook.meta.id, "number": str(event.number), "hostname": hostname},
                )
            )
        await self._deploy_to(hook, env.meta.id, event)

    async def _remove_preview(self, hook: pb.GitHook | None, env: pb.Environment, reason: str) -> None:
        assert self.writer is not None
        writer = self.writer

        def decide() -> Attempt[None]:
            current = self.view.env(env.meta.id)
            if current is None:
                return Attempt(None, None)
            return Attempt(plan_preview_removal(self.view, writer, current, self.clock.now()), None)

        await commit_with_retry(writer, decide, clock=self.clock, contended=f"preview {env.name}")
        await self.events.publish(
            make_event(
                "preview.deleted",
                f"preview env {env.name} deleted ({reason})",
                project_id=env.project_id,
                app_id=env.app_id,
                fields={
                    "hook": hook.meta.id if hook else "",
                    "number": str(env.preview_pr_number),
                    "reason": reason,
                },
            )
        )

    async def _deploy_to(self, hook: pb.GitHook, env_id: str, event: G.Event) -> None:
        assert self.writer is not None
        writer = self.writer
        auth, token = self._auth(hook)

        async def attempt() -> str:
            return await self._deploy(
                writer,
                env_id=env_id,
                repo_url=hook.repo_url,
                sha=event.sha,
                ref=event.head_ref,
                auth_header=auth,
                actor=f"githook:{hook.meta.id}",
                author=event.author,
                message=event.message,
            )

        try:
            deployment_id = await attempt()
        except FailedPrecondition:
            await self._supersede(env_id)
            deployment_id = await attempt()
        env = self.view.env(env_id)
        await self.events.publish(
            make_event(
                "git.deploy",
                f"commit {event.sha[:12]} of {event.head_ref} deploying (deployment {deployment_id})",
                project_id=env.project_id if env else "",
                app_id=env.app_id if env else "",
                environment_id=env_id,
                fields={"hook": hook.meta.id, "sha": event.sha, "ref": event.head_ref, "deployment": deployment_id},
            )
        )
        if token and event.repo:
            record = pb.GitDeploy(hook_id=hook.meta.id, environment_id=env_id, sha=event.sha, repo=event.repo)
            record.meta.id = deployment_id
            record.meta.created_at.FromSeconds(int(self.clock.now()))
            await self.writer.commit(self.writer.txn("gitdeploy").create(record))

    async def _supersede(self, env_id: str) -> None:
        """A newer commit supersedes the deployments under way in ``env_id`` (not yet promoted): cancel
        them and wait (at most ``supersede_wait``) until the orchestrator has ended them."""
        assert self.writer is not None
        deployer = Deployer(self.writer, clock=self.clock, created_by="githooks")
        for deployment in blocking_deployments(self.view, env_id):
            await deployer.cancel(deployment.meta.id)
        feed = self.view.subscribe({K.DEPLOYMENT})
        try:
            deadline = self.clock.now() + self.settings.supersede_wait
            while blocking_deployments(self.view, env_id):
                remaining = deadline - self.clock.now()
                if remaining <= 0:
                    return  # the deploy is tried anyway, and refused with the reason
                await wait_or_timer(self.clock, feed.wait(), remaining)
        finally:
            feed.close()

    # ------------------------------------------------------------------ passes

    async def run_pass(self) -> None:
        for env in expired_previews(self.view, self.clock.now()):
            await self._remove_preview(None, env, "expired")
        for record in list(self.view.all(K.GIT_DEPLOY)):
            if isinstance(record, pb.GitDeploy):
                await self._report(record)

    async def _report(self, record: pb.GitDeploy) -> None:
        assert self.writer is not None
        hook = self.view.get(K.GIT_HOOK, record.hook_id)
        deployment = self.view.deployment(record.meta.id)
        state = commit_state(deployment)
        if not isinstance(hook, pb.GitHook):
            await self.writer.commit(self.writer.txn().delete(K.git_deploy(record.meta.id)))
            return
        if state != record.reported:
            token = open_hook(self._keyring(), hook).get("token", "")
            if not token or not await self._post_status(hook, record, state, token, deployment):
                return  # tried again next pass
        if state == "pending":
            if state != record.reported:
                updated = pb.GitDeploy()
                updated.CopyFrom(record)
                updated.reported = state
                await self.writer.commit(self.writer.txn().put(updated))
            return
        await self.writer.commit(self.writer.txn().delete(K.git_deploy(record.meta.id)))

    async def _post_status(
        self, hook: pb.GitHook, record: pb.GitDeploy, state: str, token: str, deployment: pb.Deployment | None
    ) -> bool:
        api = hook.api_url or G.default_api_url(hook.provider, hook.repo_url)
        target = f"{hook.console_url}/env/{record.environment_id}" if hook.console_url else ""
        description = {
            "pending": "deploying",
            "success": "deployed",
            "failure": (deployment.error if deployment is not None and deployment.error else "deploy failed"),
        }[state]
        request = G.status_request(hook.provider, api, record.repo, record.sha, state, token, target, description)
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.status_timeout)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(request.url, json=request.body, headers=request.headers) as response,
            ):
                if response.status < 300:
                    return True
                log.warning("git hook %s: commit status answered %d", hook.meta.id, response.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("git hook %s: commit status not posted: %s", hook.meta.id, type(exc).__name__)
        return False
