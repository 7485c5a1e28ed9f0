"""``zattera domains list|add|remove``: hostnames routed to environments and their certificates
(docs/certificates.md).

``add`` routes a hostname to an environment (a ``Domain`` record); the certificate loop then obtains its
certificate. ``list`` shows each hostname's certificate state: pending, valid (until), renewing, or failed
with the CA's reason. Nothing here touches key material.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, run
from cli.config_cmds import ENV, JSON, fail, say, target_env
from shared import keys as K
from shared.certs import DomainRow, domain_rows, hostname_problem, utc_text
from shared.ids import new_id

domains_app = typer.Typer(no_args_is_help=True, help="Hostnames routed to environments, and their certificates.")

HOSTNAME = typer.Argument(..., help="the hostname, e.g. www.example.com")


def _check(hostname: str) -> str:
    problem = hostname_problem(hostname)
    if problem is not None:
        raise fail(f"hostname: {problem}")
    return hostname


@domains_app.command("add")
def domains_add(hostname: str = HOSTNAME, env: str = ENV) -> None:
    """Route HOSTNAME to an environment; its certificate is obtained automatically."""
    _check(hostname)

    async def go() -> str:
        from cli.apply import env_label, env_path

        async with control() as c:
            target = target_env(c.view, env)
            for other in c.view.domains():
                if other.hostname == hostname:
                    where = env_label(c.view, other.environment_id)
                    raise fail(f"hostname: {hostname} is already routed to {where}")
            domain = pb.Domain(
                project_id=target.project_id, app_id=target.app_id, environment_id=target.meta.id, hostname=hostname
            )
            domain.meta.id = new_id()
            domain.meta.created_at.FromNanoseconds(time.time_ns())
            domain.meta.updated_at.CopyFrom(domain.meta.created_at)
            await c.writer.commit(c.writer.txn("cli.domains.add").create(domain))
            return env_path(c.view, target)

    where = run(go)
    say(f"domain {hostname} routed to {where}; its certificate is pending (`zattera domains list`)")


@domains_app.command("remove")
def domains_remove(hostname: str = HOSTNAME) -> None:
    """Stop routing HOSTNAME; its certificate is deleted by the certificate loop."""

    async def go() -> None:
        async with control() as c:
            doomed = [d for d in c.view.domains() if d.hostname == hostname]
            if not doomed:
                raise fail(f"hostname: no domain {hostname!r} (see `zattera domains list`)")
            txn = c.writer.txn("cli.domains.remove")
            for domain in doomed:
                txn.delete(K.domain(domain.meta.id))
            await c.writer.commit(txn)

    run(go)
    say(f"domain {hostname} removed")


@domains_app.command("list")
def domains_list(json: bool = JSON) -> None:
    """Every hostname with a domain or a certificate: certificate state, expiry, renewal, the CA's error."""

    async def go() -> list[DomainRow]:
        from cli.apply import env_label

        async with control() as c:
            return domain_rows(c.view, time.time(), lambda env_id: env_label(c.view, env_id))

    rows = run(go)
    if json:
        render.emit_json([asdict(r) for r in rows])
        return
    render.table(
        "domains",
        ["hostname", "environment", "certificate", "valid until", "renews", "issuer", render.Col("error", wrap=True)],
        [
            [
                r.hostname,
                r.environment or "-",
                r.state,
                utc_text(r.valid_until),
                utc_text(r.renew_at),
                r.issuer or "-",
                r.error or "-",
            ]
            for r in rows
        ],
    )
