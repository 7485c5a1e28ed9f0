"""The ``zattera`` command: its entry point (:func:`main`).

A plain read (``zattera status``, ``zattera ps``) spelled with only the options it takes runs directly
(:data:`READS`), without loading typer and its command building: interpreter start-up and imports are most
of a read's time (PERFORMANCE.md "CLI start-up"). Every other command line, ``--help`` and anything
unexpected included, goes to the typer app (:mod:`cli.app`), which also runs these reads. ``app`` is
importable from here as before.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cli.startup import apply_root_options, import_nats, paused_gc

ROOT_OPTIONS = {"--nats": "nats"}
"""The root options a direct read takes (each with a value), as in :func:`cli.app.root`."""
NATS_ENV = "ZATTERA_NATS_URL"

READS: dict[str, tuple[str, dict[str, str], dict[str, str]]] = {
    "status": ("status", {"--env": "env"}, {"--json": "as_json"}),
    "ps": ("ps", {"--env": "env"}, {"--json": "as_json", "--wide": "wide"}),
}
"""Command → (function in :mod:`cli.reads`, options with a value → parameter, flags → parameter). The same
options as the typer commands (``tests/cli/test_read_fast_path.py`` compares them)."""


def direct_read(argv: Sequence[str]) -> tuple[str, str, dict[str, Any]] | None:
    """(command, NATS URL option, the read's arguments) when ``argv`` is a plain read spelled only with the
    options it takes (``--opt VALUE``, ``--opt=VALUE``, flags; the last one given wins, as in typer);
    None for anything else, which typer parses (and explains when it is wrong)."""
    if any(name.startswith("_") and name.endswith("_COMPLETE") for name in os.environ):
        return None  # shell completion: typer's
    nats = os.environ.get(NATS_ENV, "")
    args = list(argv)
    command = ""
    values: dict[str, Any] = {}
    while args:
        word = args.pop(0)
        if command:
            valued, flags = READS[command][1], READS[command][2]
        elif word in READS:
            command = word
            continue
        else:
            valued, flags = ROOT_OPTIONS, {}
        name, given, value = word.partition("=")
        if name in valued:
            if not given:
                if not args or args[0].startswith("-"):
                    return None
                value = args.pop(0)
            if command:
                values[valued[name]] = value
            else:
                nats = value
        elif word in flags:
            values[flags[word]] = True
        else:
            return None
    if not command:
        return None
    return command, nats, values


def _finish_as_typer(exc: BaseException) -> None:
    """End the process as typer ends it when a command raises ``exc``: its exit code for ``typer.Exit``,
    130 for Ctrl-C, its error and traceback display otherwise."""
    import typer

    finisher = typer.Typer()

    @finisher.command()
    def command() -> None:
        raise exc

    finisher(args=[], prog_name="zattera")


def run_read(command: str, nats: str, values: dict[str, Any]) -> None:
    with paused_gc(freeze=True):
        import_nats()
        from cli import reads

        read: Callable[..., None] = getattr(reads, READS[command][0])
    apply_root_options(nats)
    try:
        read(**values)
    except SystemExit:
        raise
    except BaseException as exc:  # every exception ends as typer ends it
        _finish_as_typer(exc)
    sys.exit(0)


def main() -> None:
    from cli.lognotices import quiet_asyncio_tls_notice

    quiet_asyncio_tls_notice()
    read = direct_read(sys.argv[1:])
    if read is not None:
        run_read(*read)
    with paused_gc(freeze=True):
        from cli.app import app
    app()


def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, loaded when asked for (`from cli.main import app`)
        from cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["main"]
