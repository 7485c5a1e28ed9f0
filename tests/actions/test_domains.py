"""Routing hostnames to environments (shared/actions/domains.py) on real NATS."""

from __future__ import annotations

import pytest

from shared.actions.context import ActionContext
from shared.actions.domains import AddDomain, RemoveDomain, add_domain, remove_domain
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.txn import Writer
from tests.actions.conftest import ENV_ID, PATH, named


async def test_a_hostname_is_routed_once_and_removed(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    added = await add_domain(ctx, AddDomain("www.example.com", PATH))
    assert (added.env_id, added.env) == (ENV_ID, PATH)
    assert [d.hostname for d in ctx.view.domains(ENV_ID)] == ["www.example.com"]
    with pytest.raises(Conflicting, match=f"^www.example.com is already routed to {PATH}$") as twice:
        await add_domain(ctx, AddDomain("www.example.com", ENV_ID))
    assert twice.value.field == "hostname"
    await remove_domain(ctx, RemoveDomain("www.example.com"))
    assert ctx.view.domains() == []
    with pytest.raises(NotFound, match=r"no domain 'www\.example\.com'"):
        await remove_domain(ctx, RemoveDomain("www.example.com"))


async def test_a_hostname_that_cannot_have_a_certificate_is_invalid(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    with pytest.raises(Invalid, match=r"^hostname: '\*.example.com' is a wildcard"):
        await add_domain(ctx, AddDomain("*.example.com", PATH))
    assert ctx.view.domains() == []
