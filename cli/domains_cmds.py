"""``zattera domains list|add|remove``: hostnames routed to environments and their certificates
(docs/certificates.md).

``add`` and ``remove`` are operator actions (:mod:`shared.actions.domains`). ``list`` shows each hostname's
certificate state: pending, valid (until), renewing, or failed with the CA's reason. Nothing here touches
key material.
"""

from __future__ import annotations

import time

import typer

from cli import render
from cli.client import control, on_cluster, run, say
from cli.config_cmds import ENV
from cli.options import JSON, set_output
from shared.actions.domains import AddDomain, RemoveDomain, add_domain, remove_domain
from shared.actions.names import env_label
from shared.certs import DomainRow, domain_rows, utc_text

domains_app = typer.Typer(no_args_is_help=True, help="Hostnames routed to environments, and their certificates.")

HOSTNAME = typer.Argument(..., help="the hostname, e.g. www.example.com")


@domains_app.command("add")
def domains_add(hostname: str = HOSTNAME, env: str = ENV) -> None:
    """Route HOSTNAME to an environment; its certificate is obtained automatically."""

    done = on_cluster(add_domain, AddDomain(hostname, env))
    say(f"domain {hostname} routed to {done.env}; its certificate is pending (`zattera domains list`)")


@domains_app.command("remove")
def domains_remove(hostname: str = HOSTNAME) -> None:
    """Stop routing HOSTNAME; the certificate loop deletes its certificate an hour later."""

    async def go() -> None:
        async with control() as c:
            await remove_domain(c.actions, RemoveDomain(hostname))

    run(go)
    say(f"domain {hostname} removed")


@domains_app.command("list")
def domains_list(json: bool = JSON) -> None:
    """Every hostname with a domain or a certificate: certificate state, expiry, renewal, the CA's error."""

    async def go() -> list[DomainRow]:
        async with control() as c:
            return domain_rows(c.view, time.time(), lambda env_id: env_label(c.view, env_id))

    set_output(json)
    render.listing(
        "domains",
        ["hostname", "environment", "certificate", "valid until", "renews", "issuer", render.Col("error", wrap=True)],
        run(go),
        lambda r: [
            r.hostname,
            r.environment or "-",
            r.state,
            utc_text(r.valid_until),
            utc_text(r.renew_at),
            r.issuer or "-",
            r.error or "-",
        ],
    )
