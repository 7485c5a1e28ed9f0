"""``zattera context add/use/list/remove``: saved cluster connections (cli/contexts.py), used by every
command when neither ``--nats`` nor ``ZATTERA_NATS_URL`` is given."""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError

from cli import contexts, render
from cli.client import fail
from cli.context_models import Context, ContextFile
from cli.options import JSON, set_output

context_app = typer.Typer(no_args_is_help=True, help="Saved cluster connections (URLs, credentials, TLS CA).")


def _loaded() -> ContextFile:
    try:
        return contexts.load()
    except contexts.ContextError as exc:
        raise fail(str(exc)) from None


def _existing_file(value: str, option: str) -> str:
    if not value:
        return ""
    path = Path(value).expanduser()
    if not path.is_file():
        raise fail(f"{option} {value!r}: no such file")
    return str(path.resolve())


@context_app.command("add")
def add(
    name: str = typer.Argument(..., help="a name for this cluster, e.g. prod"),
    nats: str = typer.Option(..., "--nats", help="NATS URL(s), comma-separated"),
    creds: str = typer.Option("", "--creds", help="NATS credentials file (secured clusters)"),
    tls_ca: str = typer.Option("", "--tls-ca", help="CA file the NATS server certificate must chain to"),
) -> None:
    """Save (or replace) a context; the first one saved becomes the one in use."""
    try:
        contexts.check_name(name)
        context = Context(nats=nats, creds=_existing_file(creds, "--creds"), tls_ca=_existing_file(tls_ca, "--tls-ca"))
    except contexts.ContextError as exc:
        raise fail(str(exc)) from None
    except ValidationError as exc:
        raise fail(f"--nats: {exc.errors()[0]['msg']}") from None
    saved = _loaded()
    saved.contexts[name] = context
    if not saved.current:
        saved.current = name
    contexts.save(saved)
    typer.echo(f"context {name!r} saved{' and in use' if saved.current == name else ''} ({contexts.path()})")


@context_app.command("use")
def use(name: str = typer.Argument(..., help="a saved context")) -> None:
    """Use this context from now on."""
    saved = _loaded()
    if name not in saved.contexts:
        raise fail(f"no context {name!r} (saved: {', '.join(sorted(saved.contexts)) or 'none'})")
    saved.current = name
    contexts.save(saved)
    typer.echo(f"using context {name!r}: {saved.contexts[name].nats}")


@context_app.command("list")
def list_contexts(json: bool = JSON) -> None:
    """Saved contexts; the one in use is marked."""
    set_output(json)
    saved = _loaded()
    if render.json_mode():
        render.emit_json(
            [{"name": n, "current": n == saved.current, **c.model_dump()} for n, c in sorted(saved.contexts.items())]
        )
        return
    render.table(
        "contexts",
        ["", "name", "nats", "creds", "tls ca"],
        [
            ["*" if n == saved.current else "", n, c.nats, c.creds or "-", c.tls_ca or "-"]
            for n, c in sorted(saved.contexts.items())
        ],
    )


@context_app.command("remove")
def remove(name: str = typer.Argument(..., help="a saved context")) -> None:
    """Forget a context (the files it names are left alone)."""
    saved = _loaded()
    if saved.contexts.pop(name, None) is None:
        raise fail(f"no context {name!r}")
    if saved.current == name:
        saved.current = ""
    contexts.save(saved)
    typer.echo(f"context {name!r} removed")
