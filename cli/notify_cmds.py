"""``zattera notify add|list|remove|test``: notification channels (docs/notifications.md). The work is in
:mod:`shared.actions.notify`; the control plane's ``notify`` loop delivers.

The channel's URL is read from ``--url`` or, to keep a webhook token out of shell history and process
listings, from ``ZATTERA_NOTIFY_URL``; it is stored sealed and shown without its path.
"""

from __future__ import annotations

import dataclasses
import os

import typer

from cli import render
from cli.client import fail, on_cluster, read_on_cluster, say
from cli.options import JSON, set_output
from shared.actions.notify import (
    AddChannel,
    RemoveChannel,
    SendTest,
    add_channel,
    list_channels,
    remove_channel,
    send_test,
)
from shared.notify import DEFAULT_EVENTS, FORMATS

URL_ENV = "ZATTERA_NOTIFY_URL"

notify_app = typer.Typer(
    no_args_is_help=True, help="Notifications to webhooks, Slack and Discord (docs/notifications.md)."
)


@notify_app.command("add")
def add(
    name: str = typer.Argument(..., metavar="NAME"),
    url: str = typer.Option("", "--url", help=f"where deliveries go (or ${URL_ENV}, kept out of the shell history)"),
    format: str = typer.Option("generic", "--format", help=f"the body: {' | '.join(FORMATS)}"),
    events: str = typer.Option(
        "", "--events", help=f"event kinds, comma-separated, patterns allowed (default: {','.join(DEFAULT_EVENTS)})"
    ),
    project: str = typer.Option("", "--project", help="only this project's events"),
    console_url: str = typer.Option(
        "", "--console-url", help="the console's address, for links in messages (default $ZATTERA_CONSOLE_URL)"
    ),
    json: bool = JSON,
) -> None:
    """Add (or replace) a notification channel. Deliveries are signed: the signing secret is printed once
    (on stdout), for the receiver to check `Zattera-Signature`."""
    set_output(json)
    target = url or os.environ.get(URL_ENV, "")
    if not target:
        raise fail(f"--url: give the channel's URL (or set {URL_ENV})")
    kinds = [k.strip() for k in events.split(",") if k.strip()]
    request = AddChannel(name, target, format, kinds, project, console_url or os.environ.get("ZATTERA_CONSOLE_URL", ""))
    added = on_cluster(add_channel, request)
    if render.json_mode():
        render.emit_json(
            {**dataclasses.asdict(added.channel), "signing_secret": added.signing_secret, "replaced": added.replaced}
        )
        return
    c = added.channel
    verb = "replaced" if added.replaced else "added"
    scope = f" of project {c.project}" if c.project else ""
    say(f"channel {c.name} {verb}: {c.format} to {c.url}, events {', '.join(c.events)}{scope}")
    say("signing secret (shown once; receivers verify Zattera-Signature with it):")
    print(added.signing_secret)


@notify_app.command("list")
def list_cmd(json: bool = JSON) -> None:
    """The channels and how their deliveries go."""
    set_output(json)
    render.listing(
        "notification channels",
        ["name", "format", "url", "events", "project", "delivered", "last", "state"],
        read_on_cluster(list_channels),
        lambda c: [
            c.name,
            c.format,
            c.url,
            ",".join(c.events),
            c.project or "-",
            c.delivered,
            render.when(c.last_delivered_at),
            render.delivery_state(c.failing, c.failing_since, c.failures, c.last_error),
        ],
    )


@notify_app.command("remove")
def remove(name: str = typer.Argument(..., metavar="NAME"), json: bool = JSON) -> None:
    """Remove a channel (what it has not delivered yet is dropped)."""
    set_output(json)
    on_cluster(remove_channel, RemoveChannel(name))
    render.report({"name": name, "removed": True}, f"channel {name} removed")


@notify_app.command("test")
def test(
    name: str = typer.Argument(..., metavar="NAME"),
    wait: float = typer.Option(30.0, "--wait", help="seconds to wait for the delivery"),
    json: bool = JSON,
) -> None:
    """Send a test notification through the same path as every other and wait for its delivery; exits 1
    when it was not delivered."""
    set_output(json)
    result = on_cluster(send_test, SendTest(name, wait), follow=True)
    if render.json_mode():
        render.emit_json(dataclasses.asdict(result))
    elif result.delivered:
        say(f"channel {name}: test notification delivered")
    else:
        say(f"channel {name}: not delivered: {result.error}")
    if not result.delivered:
        raise typer.Exit(1)
