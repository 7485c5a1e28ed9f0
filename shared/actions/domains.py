"""Hostnames routed to environments (``zattera domains add|remove``; docs/certificates.md).

``add_domain`` routes a hostname to an environment (a ``Domain`` record); the certificate loop then
obtains its certificate and the route builder routes it. ``remove_domain`` stops routing it; the
certificate loop deletes its certificate an hour later. Nothing here touches key material.
"""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit
from shared.actions.fields import EnvPath, EnvRef
from shared.actions.names import env_label, target_env
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.certs import hostname_problem
from shared.records import new_meta
from shared.retry import Attempt


@dataclass(frozen=True, slots=True)
class AddDomain:
    hostname: str
    env: EnvRef


@dataclass(frozen=True, slots=True)
class DomainAdded:
    hostname: str
    domain_id: str
    env_id: str
    env: EnvPath


@dataclass(frozen=True, slots=True)
class RemoveDomain:
    hostname: str


@dataclass(frozen=True, slots=True)
class DomainRemoved:
    hostname: str


async def add_domain(ctx: ActionContext, request: AddDomain) -> DomainAdded:
    hostname = request.hostname
    problem = hostname_problem(hostname)
    if problem is not None:
        raise Invalid("hostname", problem)

    def attempt() -> Attempt[pb.Domain]:
        env = target_env(ctx.view, request.env)
        for other in ctx.view.domains():
            if other.hostname == hostname:
                where = env_label(ctx.view, other.environment_id)
                raise Conflicting(f"{hostname} is already routed to {where}", field="hostname")
        domain = pb.Domain(project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id, hostname=hostname)
        new_meta(domain.meta, ctx.clock.now())
        return Attempt(ctx.writer.txn("domains.add").create(domain), domain)

    domain = await commit(ctx, attempt, contended=f"hostname {hostname}")
    return DomainAdded(hostname, domain.meta.id, domain.environment_id, env_label(ctx.view, domain.environment_id))


async def remove_domain(ctx: ActionContext, request: RemoveDomain) -> DomainRemoved:
    hostname = request.hostname

    def attempt() -> Attempt[None]:
        doomed = [d for d in ctx.view.domains() if d.hostname == hostname]
        if not doomed:
            raise NotFound(f"no domain {hostname!r} (see `zattera domains list`)", field="hostname")
        txn = ctx.writer.txn("domains.remove")
        for domain in doomed:
            txn.delete(K.domain(domain.meta.id))
        return Attempt(txn, None)

    await commit(ctx, attempt, contended=f"hostname {hostname}")
    return DomainRemoved(hostname)
