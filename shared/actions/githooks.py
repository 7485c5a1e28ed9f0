"""Webhooks from git hosts and the preview environments they make (docs/git.md, "Webhooks and previews"):
``add_hook``, ``list_hooks``, ``remove_hook`` (``zattera git hook add|list|remove``), and the writes of the
``githooks`` leader loop (services/secrets/githooks.py): ``plan_preview`` (create or refresh env
``pr-<n>``), ``plan_preview_removal``.

A hook is one record (``githook.<id>``). Its secret (what GitHub and Gitea sign deliveries with, what
GitLab sends) and the repository's token are sealed together to the cluster secrets key, as a notification
channel's are (actions/notify.py): only the secrets service opens them. The secret is returned once.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from zattera.v1 import types_pb2 as pb

from shared import githooks as G
from shared import keys as K
from shared.actions.context import ActionContext, commit_edit, stamp_replacing
from shared.actions.deletion import plan_deletion
from shared.actions.fields import EnvPath, EnvRef
from shared.actions.names import env_label, env_path, target_env
from shared.actions.refusals import Invalid, NotFound
from shared.backup.sealed import seal_settings
from shared.clock import from_timestamp, stamp
from shared.ids import new_id
from shared.records import new_meta
from shared.state.reader import StateReader
from shared.txn import Txn, Writer

HOOKS_PATH = "/hooks"
"""The console's path prefix of webhook endpoints: ``/hooks/<provider>/<hook id>``."""

BRANCH_RE = re.compile(r"^[A-Za-z0-9._/-]{1,200}$")


@dataclass(frozen=True)
class AddHook:
    env: EnvRef
    """The base environment."""
    provider: str
    repo_url: str
    branch: str = "main"
    token: str = field(default="", repr=False)
    """The repository token: fetch auth for a private repository, and commit statuses ("" = neither)."""
    previews: bool = False
    preview_label: str = ""
    preview_ttl: float = 0.0
    """Seconds after a preview's last update that it is deleted (0 = only when its pull request closes)."""
    shared_secrets: list[str] = field(default_factory=list)
    api_url: str = ""
    console_url: str = ""


@dataclass(frozen=True)
class Hook:
    id: str
    env: EnvPath
    provider: str
    repo_url: str
    branch: str
    path: str
    """The endpoint's path on the console's listener."""
    has_token: bool
    previews: bool
    preview_label: str
    preview_ttl: float
    shared_secrets: list[str]
    api_url: str
    previews_live: list[str] = field(default_factory=list)
    """The preview envs of this hook's base env (``pr-<n>``)."""


@dataclass(frozen=True)
class HookAdded:
    hook: Hook
    url: str
    """The endpoint URL when the console URL is known, else its path."""
    secret: str = field(repr=False)
    """Shown once: paste it in the git host's webhook settings."""


def endpoint_path(provider: str, hook_id: str) -> str:
    return f"{HOOKS_PATH}/{provider}/{hook_id}"


def describe(view: StateReader, hook: pb.GitHook) -> Hook:
    env = view.env(hook.environment_id)
    previews = [e.name for e in preview_envs(view, hook.environment_id)] if env is not None else []
    return Hook(
        id=hook.meta.id,
        env=env_label(view, hook.environment_id),
        provider=hook.provider,
        repo_url=hook.repo_url,
        branch=hook.branch,
        path=endpoint_path(hook.provider, hook.meta.id),
        has_token=hook.has_token,
        previews=hook.previews,
        preview_label=hook.preview_label,
        preview_ttl=hook.preview_ttl.ToTimedelta().total_seconds(),
        shared_secrets=list(hook.shared_secrets),
        api_url=hook.api_url,
        previews_live=previews,
    )


def _check(request: AddHook) -> None:
    problem = G.provider_problem(request.provider)
    if problem:
        raise Invalid("provider", problem, said="--provider")
    problem = G.repo_url_problem(request.repo_url)
    if problem:
        raise Invalid("repo_url", problem, said="--repo")
    if not BRANCH_RE.match(request.branch) or ".." in request.branch:
        raise Invalid("branch", f"{request.branch!r} is not a branch name", said="--branch")
    if request.preview_ttl < 0:
        raise Invalid("preview_ttl", "must be 0 (no expiry) or more", said="--preview-ttl")
    if (request.preview_label or request.preview_ttl or request.shared_secrets) and not request.previews:
        raise Invalid(
            "previews", "--preview-label, --preview-ttl and --share-secret need --previews", said="--previews"
        )
    for url, option in ((request.api_url, "--api-url"), (request.console_url, "--console-url")):
        if (url and G.repo_url_problem(url)) or (url and not url.startswith(("http://", "https://"))):
            raise Invalid(option.removeprefix("--").replace("-", "_"), f"{url!r} is not an http(s) URL", said=option)
    if request.token and any(c in request.token for c in "\r\n"):
        raise Invalid("token", "holds a line break (give the token alone in the file)", said="--token-file")


async def add_hook(ctx: ActionContext, request: AddHook) -> HookAdded:
    """Add a hook to an env: deliveries to its endpoint are verified with a new secret (shown once)."""
    _check(request)
    env = target_env(ctx.view, request.env)
    for name in request.shared_secrets:
        if name not in env.service.secrets:
            raise Invalid("shared_secrets", f"{env_path(ctx.view, env)} has no secret {name!r}", said="--share-secret")
    secret = secrets.token_urlsafe(32)
    sealed = seal_settings(ctx.view, {"secret": secret, "token": request.token}, "the hook's secret")
    hook_id = new_id().lower()

    def edit() -> pb.GitHook:
        record = pb.GitHook(
            environment_id=env.meta.id,
            provider=request.provider,
            repo_url=request.repo_url,
            branch=request.branch,
            sealed=sealed.sealed,
            key_id=sealed.key_id,
            has_token=bool(request.token),
            previews=request.previews,
            preview_label=request.preview_label,
            shared_secrets=sorted(set(request.shared_secrets)),
            api_url=request.api_url.rstrip("/"),
            console_url=request.console_url.rstrip("/"),
        )
        record.preview_ttl.FromNanoseconds(int(request.preview_ttl * 1e9))
        record.meta.id = hook_id
        stamp_replacing(record, None)
        return record

    written = await commit_edit(ctx, f"hook {hook_id}", edit)
    assert written is not None
    path = endpoint_path(request.provider, hook_id)
    url = f"{request.console_url.rstrip('/')}{path}" if request.console_url else path
    return HookAdded(describe(ctx.view, written), url, secret)


def list_hooks(ctx: ActionContext) -> list[Hook]:
    return [
        describe(ctx.view, h)
        for h in sorted(ctx.view.all(K.GIT_HOOK), key=lambda r: r.meta.id)
        if isinstance(h, pb.GitHook)
    ]


@dataclass(frozen=True)
class RemoveHook:
    hook_id: str


async def remove_hook(ctx: ActionContext, request: RemoveHook) -> None:
    """Remove a hook (its previews stay until their TTL or a ``zattera envs delete``)."""
    if ctx.view.get(K.GIT_HOOK, request.hook_id) is None:
        raise NotFound(f"no git hook {request.hook_id!r} (see `zattera git hook list`)", field="hook_id")
    await ctx.writer.commit(ctx.writer.txn().delete(K.git_hook(request.hook_id)))


# ---------------------------------------------------------------------------------------------- previews


def preview_envs(view: StateReader, base_env_id: str) -> list[pb.Environment]:
    """The previews made from ``base_env_id``: envs of its app of type PREVIEW."""
    base = view.env(base_env_id)
    if base is None:
        return []
    return [e for e in view.envs() if e.app_id == base.app_id and e.type == pb.ENVIRONMENT_TYPE_PREVIEW]


def find_preview(view: StateReader, base: pb.Environment, number: int) -> pb.Environment | None:
    name = G.preview_env_name(number)
    return next((e for e in view.envs() if e.app_id == base.app_id and e.name == name), None)


def preview_spec(base: pb.ServiceSpec) -> pb.ServiceSpec:
    """The base env's spec as a preview runs it: scale-to-zero (min 0), at most the base's maximum, no
    public L4 ports (they are cluster-wide: the base holds them), no secrets (copied one by one)."""
    spec = pb.ServiceSpec()
    spec.CopyFrom(base)
    spec.scale_to_zero = True
    spec.replicas.min = 0
    spec.replicas.max = max(spec.replicas.max, 1)
    for port in spec.ports:
        port.public_l4_port = 0
    spec.ClearField("secrets")
    spec.ClearField("volumes")  # a preview gets no copy of the base's data
    spec.stateful = False
    return spec


class PreviewPlan(NamedTuple):
    """A preview's decision (what the loop commits), not a request or result: no wire form."""

    txn: Txn | None
    env: pb.Environment
    created: bool


def plan_preview(
    view: StateReader,
    writer: Writer,
    hook: pb.GitHook,
    event: G.Event,
    *,
    domain: str,
    now: float,
) -> PreviewPlan:
    """Create env ``pr-<n>`` from the hook's base env (its spec, its config, the secrets marked shareable,
    a Domain ``pr-<n>.<app>.<domain>``) or, when it exists, push its expiry back. Raises :class:`NotFound`
    when the base env is gone."""
    base = view.env(hook.environment_id)
    if base is None:
        raise NotFound(f"the hook's env {hook.environment_id} is gone", field="environment_id")
    existing = find_preview(view, base, event.number)
    expires = now + hook.preview_ttl.ToTimedelta().total_seconds() if hook.preview_ttl.ToNanoseconds() else 0.0
    if existing is not None:
        if existing.type != pb.ENVIRONMENT_TYPE_PREVIEW:
            raise Invalid("number", f"env {existing.name} exists and is no preview")
        updated = pb.Environment()
        updated.CopyFrom(existing)
        updated.preview_branch = event.head_ref
        if expires:
            stamp(updated.preview_expires_at, expires)
        stamp(updated.meta.updated_at, now)
        return PreviewPlan(writer.txn("preview.refresh").put(updated), updated, created=False)
    app = view.app(base.app_id)
    env = pb.Environment(
        app_id=base.app_id,
        project_id=base.project_id,
        name=G.preview_env_name(event.number),
        type=pb.ENVIRONMENT_TYPE_PREVIEW,
        preview_branch=event.head_ref,
        preview_pr_number=event.number,
        effective_replicas=1,
    )
    new_meta(env.meta, now)
    if expires:
        stamp(env.preview_expires_at, expires)
    env.service.CopyFrom(preview_spec(base.service))
    if base.HasField("idle_timeout"):
        env.idle_timeout.CopyFrom(base.idle_timeout)
    if base.HasField("middleware"):
        env.middleware.CopyFrom(base.middleware)
    if base.HasField("logs"):
        env.logs.CopyFrom(base.logs)
    txn = writer.txn("preview.create")
    stamped = time.time()
    by_id = {s.meta.id: s for s in view.secrets(base.meta.id)}
    for name in hook.shared_secrets:
        ref = base.service.secrets.get(name)
        original = by_id.get(ref.secret_id) if ref is not None else None
        if ref is None or original is None:
            continue
        copy = pb.SealedSecret()
        copy.CopyFrom(original)
        new_meta(copy.meta, stamped)
        copy.environment_id = env.meta.id
        txn.create(copy)
        new_ref = env.service.secrets[name]
        new_ref.CopyFrom(ref)
        new_ref.secret_id = copy.meta.id
    txn.create(env)
    hostname = G.preview_hostname(event.number, app.name if app else "app", domain)
    if not any(d.hostname == hostname for d in view.domains()):
        dom = pb.Domain(project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id, hostname=hostname)
        new_meta(dom.meta, now)
        txn.create(dom)
    return PreviewPlan(txn, env, created=True)


def plan_preview_removal(view: StateReader, writer: Writer, env: pb.Environment, now: float) -> Txn:
    """Delete preview ``env`` with its domains (its certificate follows its domain, docs/certificates.md),
    replicas stopped, deployments ended, its secrets' copies deleted, as one batch."""
    from shared.actions.deletion import deletion_txn

    plan = plan_deletion(view, f"env {env_path(view, env)}", envs=[env], volumes=True, now=now)
    txn = deletion_txn(writer, plan)
    for secret in view.secrets(env.meta.id):
        txn.delete(K.secret(secret.meta.id))
    return txn


def expired_previews(view: StateReader, now: float) -> list[pb.Environment]:
    """Previews whose TTL has passed (no push, no reopen since)."""
    return [
        e
        for e in view.envs()
        if e.type == pb.ENVIRONMENT_TYPE_PREVIEW
        and e.HasField("preview_expires_at")
        and 0 < from_timestamp(e.preview_expires_at) <= now
    ]
