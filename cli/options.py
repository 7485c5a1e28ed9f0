"""Options and lookups that several command groups share."""

from __future__ import annotations

import typer
from zattera.v1 import types_pb2 as pb

from cli.client import OPTIONS, fail
from shared.names import resolve_env
from shared.state.reader import StateReader

JSON = typer.Option(False, "--json", help="machine-readable output")
WIDE = typer.Option(False, "--wide", help="every column, ids included")


def set_output(flag: bool, wide: bool = False) -> bool:
    """Record ``--json`` and ``--wide`` for :mod:`cli.render`; returns ``--json``."""
    OPTIONS.json = flag
    OPTIONS.wide = wide
    return flag


def env_or_fail(view: StateReader, ref: str) -> pb.Environment:
    """The environment ``--env`` names (an id or project/app/env), else a one-line failure."""
    env = resolve_env(view, ref)
    if env is None:
        raise fail(f"--env: no environment {ref!r} (use an id or project/app/env)")
    return env
