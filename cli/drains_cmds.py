"""``zattera drains add|list|remove``: log drains (docs/logs.md "Drains"). The work is in
:mod:`shared.actions.drains`; the control plane's ``drains`` loop delivers.

The drain's URL is read from ``--url`` or, to keep credentials out of shell history and process listings,
from ``ZATTERA_DRAIN_URL``; it is stored sealed (with the ``--header`` values and the ``--ca-file``) and shown
as ``scheme://host:port`` only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import typer

from cli import render
from cli.client import fail, on_cluster, read_on_cluster, say
from cli.options import JSON, set_output
from shared.actions.drains import AddDrain, RemoveDrain, add_drain, list_drains, remove_drain
from shared.drain_status import Drain
from shared.drains import SCHEMES

URL_ENV = "ZATTERA_DRAIN_URL"

drains_app = typer.Typer(
    no_args_is_help=True, help="Log drains: app logs to syslog, HTTP or OTLP receivers (docs/logs.md)."
)


def state(drain: Drain) -> str:
    """``ok``, ``retrying (N failed): why`` or ``FAILING since …: why`` (the last error alone when it did not
    fail a delivery)."""
    return render.delivery_state(
        drain.failing, drain.failing_since, drain.failures, drain.last_error, drain.last_error or "ok"
    )


@drains_app.command("add")
def add(
    name: str = typer.Argument(..., metavar="NAME"),
    env: str = typer.Option("", "--env", help="the environment whose logs it ships (project/app/env)"),
    project: str = typer.Option("", "--project", help="every environment of this project"),
    url: str = typer.Option(
        "", "--url", help=f"{' | '.join(s + '://…' for s in SCHEMES)} (or ${URL_ENV}, kept out of the shell history)"
    ),
    events: bool = typer.Option(False, "--events", help="also ship the platform events of its environment(s)"),
    header: list[str] = typer.Option([], "--header", help="'Name: value' sent with each HTTP/OTLP request (sealed)"),
    ca_file: Path | None = typer.Option(
        None, "--ca-file", help="a PEM CA the receiver's TLS certificate is checked against"
    ),
    json: bool = JSON,
) -> None:
    """Add (or replace) a log drain: the lines stored from now on are shipped, in order, at least once."""
    set_output(json)
    target = url or os.environ.get(URL_ENV, "")
    if not target:
        raise fail(f"--url: give the drain's URL (or set {URL_ENV})")
    ca = ""
    if ca_file is not None:
        try:
            ca = ca_file.read_text()
        except OSError as exc:
            raise fail(f"--ca-file: cannot read {ca_file}: {exc.strerror}") from None
    drain, replaced = on_cluster(add_drain, AddDrain(name, target, env, project, events, list(header), ca))
    if render.json_mode():
        render.emit_json({**dataclasses.asdict(drain), "replaced": replaced})
        return
    verb = "replaced" if replaced else "added"
    what = " and platform events" if drain.events else ""
    say(f"drain {drain.name} {verb}: logs{what} of {drain.scope} to {drain.url}")


@drains_app.command("list")
def list_cmd(json: bool = JSON) -> None:
    """The drains and how their deliveries go: lines delivered, lag, lines dropped by retention, state."""
    set_output(json)
    render.listing(
        "log drains",
        ["name", "ships", "url", "delivered", "cursor", "lag (msgs)", "dropped", "last", "state"],
        read_on_cluster(list_drains),
        lambda d: [
            d.name,
            d.scope + (" +events" if d.events else ""),
            d.url,
            d.delivered_lines,
            ",".join(f"{stream}:{seq}" for stream, seq in sorted(d.cursors.items())) or "-",
            d.lag_messages,
            f"{d.dropped_messages} msg (~{d.dropped_lines} lines)" if d.dropped_messages else "0",
            render.when(d.last_delivered_at),
            state(d),
        ],
    )


@drains_app.command("remove")
def remove(name: str = typer.Argument(..., metavar="NAME"), json: bool = JSON) -> None:
    """Remove a drain (what it has not delivered yet is not delivered)."""
    set_output(json)
    on_cluster(remove_drain, RemoveDrain(name))
    render.report({"name": name, "removed": True}, f"drain {name} removed")
