"""The ``githooks`` leader loop (lease ``githooks``), the control side of git webhooks (docs/git.md,
"Webhooks and previews").

:class:`GitHooks` consumes the ``ZATTERA_GITHOOKS`` stream the gate (:mod:`services.secrets.githook_gate`)
fills, one delivery at a time. A push to the hook's branch fetches that commit and deploys it to the hook's
env (:mod:`services.secrets.githook_git`); a pull request against it creates, refreshes or deletes preview
env ``pr-<n>`` (shared/actions/githooks.py) and deploys its head there. Each pass reports webhook-triggered
deployments' states to the git host's commit-status API (``gitdeploy.<deployment>`` records) and deletes
previews whose TTL passed.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from zattera.v1 import types_pb2 as pb

from services.secrets.githook_gate import ensure_stream, open_hook
from services.secrets.githook_git import (
    STATUS_TIMEOUT,
    CommitDeployer,
    CommitRequest,
    commit_state,
    git_commit_deployer,
    post_commit_status,
)
from shared import githooks as G
from shared import keys as K
from shared.actions.githooks import expired_previews, find_preview, plan_preview, plan_preview_removal
from shared.backoff import Backoff
from shared.clock import wait_or_timer
from shared.deploy import Deployer, FailedPrecondition, blocking_deployments
from shared.events import WARNING, make_event
from shared.loop import LeaderLoop, LoopDeps
from shared.retry import Attempt, commit_with_retry
from shared.secrets import Keyring
from shared.subjects import GITHOOKS_DELIVERY_PREFIX, GITHOOKS_STREAM
from shared.tasks import raise_if_cancelling

log = logging.getLogger(__name__)

CONSUMER = "githooks"
ACK_WAIT = 300.0


@dataclass(frozen=True)
class GitHooksSettings:
    domain: str = ""
    """The cluster's app domain: previews are ``pr-<n>.<app>.<domain>`` ("" = ``localhost``)."""
    status_timeout: float = STATUS_TIMEOUT
    fetch_wait: float = 1.0
    """Seconds one pull of the stream waits for a delivery."""
    supersede_wait: float = 120.0
    """Seconds a push waits for the deployments it superseded (canceled) to end before deploying."""


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
                        raise_if_cancelling()  # nats-py turns a cancellation inside the fetch into a timeout
                        continue
                    for msg in msgs:
                        await self.handle(msg.headers or {}, msg.subject, msg.data)
                        await msg.ack()
                        backoff.reset()
            except Exception as exc:
                raise_if_cancelling()  # the term ended while nats-py was sending: stop, do not open it again
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
            await self._preview_event(
                "preview.created",
                f"pull request #{event.number} has preview env {env.name} at {hostname}",
                env,
                env.meta.id,
                hook=hook.meta.id,
                number=str(event.number),
                hostname=hostname,
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
        await self._preview_event(
            "preview.deleted",
            f"preview env {env.name} deleted ({reason})",
            env,
            "",
            hook=hook.meta.id if hook else "",
            number=str(env.preview_pr_number),
            reason=reason,
        )

    async def _preview_event(
        self, kind: str, message: str, env: pb.Environment, environment_id: str, **fields: str
    ) -> None:
        """Announce a change to preview ``env``: the event names its project and app, and ``environment_id``
        while it exists ("" once deleted)."""
        await self.events.publish(
            make_event(
                kind,
                message,
                project_id=env.project_id,
                app_id=env.app_id,
                environment_id=environment_id,
                fields=fields,
            )
        )

    async def _deploy_to(self, hook: pb.GitHook, env_id: str, event: G.Event) -> None:
        assert self.writer is not None
        writer = self.writer
        auth, token = self._auth(hook)
        request = CommitRequest(
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
            deployment_id = await self._deploy(writer, request)
        except FailedPrecondition:
            await self._supersede(env_id)
            deployment_id = await self._deploy(writer, request)
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
            if not token or not await post_commit_status(
                hook, record, state, token, deployment, timeout=self.settings.status_timeout
            ):
                return  # tried again next pass
        if state == "pending":
            if state != record.reported:
                updated = pb.GitDeploy()
                updated.CopyFrom(record)
                updated.reported = state
                await self.writer.commit(self.writer.txn().put(updated))
            return
        await self.writer.commit(self.writer.txn().delete(K.git_deploy(record.meta.id)))
