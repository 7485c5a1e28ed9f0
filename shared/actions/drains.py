"""Log drains (docs/logs.md "Drains"): ``add_drain``, ``remove_drain``, ``list_drains``.

A drain is one record (``logdrain.<name>``) that the secrets service's ``drains`` leader loop follows
(services/secrets/drains.py). Its URL (credentials in it: ``user:password@``, a token in the query), its
headers (``Authorization: …``) and a CA certificate are sealed together to the cluster secrets key; the
record shows the URL as ``scheme://host:port`` only.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from shared import drains
from shared import keys as K
from shared.actions.context import ActionContext, commit_edit, remove_with_status, stamp_replacing, with_status
from shared.actions.fields import EnvRef
from shared.actions.names import env_label, resolve_env, resolve_project
from shared.actions.refusals import Invalid, NotFound
from shared.backup.sealed import seal_settings
from shared.clock import stamp
from shared.drain_status import Drain, describe, scope_of


@dataclass(frozen=True)
class AddDrain:
    name: str
    url: str = field(repr=False)
    """Where lines go; sealed (it may hold credentials)."""
    env: EnvRef = ""
    project: str = ""
    events: bool = False
    headers: list[str] = field(default_factory=list, repr=False)
    """``Name: value`` each, sent with every HTTP or OTLP request; sealed."""
    ca_pem: str = ""
    """A CA certificate (PEM) the receiver's TLS certificate is checked against (self-signed receivers)."""


def _check(request: AddDrain) -> None:
    problem = drains.name_problem(request.name)
    if problem:
        raise Invalid("name", problem, said="NAME")
    if bool(request.env) == bool(request.project):
        raise Invalid("env", "give one of --env or --project", said="--env")
    problem = drains.url_problem(request.url)
    if problem:
        raise Invalid("url", problem, said="--url")
    for header in request.headers:
        problem = drains.header_problem(header)
        if problem:
            raise Invalid("headers", problem, said="--header")
    if request.ca_pem:
        try:
            ssl.create_default_context(cadata=request.ca_pem)
        except (ssl.SSLError, ValueError) as exc:
            raise Invalid("ca", f"not a PEM certificate ({exc.__class__.__name__})", said="--ca-file") from None


async def add_drain(ctx: ActionContext, request: AddDrain) -> tuple[Drain, bool]:
    """Add (or replace) a drain: it ships the lines stored from now on (a replaced drain keeps its start).
    Returns the drain and whether it replaced one."""
    _check(request)
    env_id = project_id = ""
    if request.env:
        env = resolve_env(ctx.view, request.env)
        if env is None:
            raise NotFound(f"no environment {request.env!r}", field="env")
        env_id = env.meta.id
        scope = f"env {env_label(ctx.view, env_id)}"
    else:
        project = resolve_project(ctx.view, request.project)
        if project is None:
            raise NotFound(f"no project {request.project!r}", field="project")
        project_id = project.meta.id
        scope = f"project {project.name}"
    settings = {"url": request.url, "headers": json.dumps(drains.parse_headers(request.headers)), "ca": request.ca_pem}
    sealed = seal_settings(ctx.view, settings, "the drain's URL and headers")
    existing = ctx.view.get(K.LOG_DRAIN, request.name)
    scheme = request.url.split("://", 1)[0]

    def edit() -> pb.LogDrain:
        record = pb.LogDrain(
            environment_id=env_id,
            project_id=project_id,
            scheme=scheme,
            sealed=sealed.sealed,
            key_id=sealed.key_id,
            url_shown=drains.shown_url(request.url),
            events=request.events,
        )
        record.meta.id = request.name
        before = ctx.view.get(K.LOG_DRAIN, request.name)
        if isinstance(before, pb.LogDrain) and before.HasField("start_at"):
            record.start_at.CopyFrom(before.start_at)
        else:
            stamp(record.start_at, ctx.clock.now())
        stamp_replacing(record, before)
        return record

    written = await commit_edit(ctx, f"drain {request.name}", edit)
    assert written is not None
    return describe(written, None, scope), existing is not None


@dataclass(frozen=True)
class RemoveDrain:
    name: str


async def remove_drain(ctx: ActionContext, request: RemoveDrain) -> None:
    """Remove a drain and its status; the drains loop deletes its consumers (what it has not delivered is
    not delivered)."""
    await remove_with_status(ctx, K.LOG_DRAIN, K.LOG_DRAIN_STATUS, request.name, "drain")


def list_drains(ctx: ActionContext) -> list[Drain]:
    """Every drain, by name, with how its delivery goes."""
    return [
        describe(record, status, scope_of(ctx.view, record))
        for record, status in with_status(ctx, K.LOG_DRAIN, pb.LogDrain, K.LOG_DRAIN_STATUS, pb.LogDrainStatus)
    ]
