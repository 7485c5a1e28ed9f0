"""Options and lookups that several command groups share."""

from __future__ import annotations

import typer

from cli.client import OPTIONS
from shared.actions.names import target_env

JSON = typer.Option(False, "--json", help="machine-readable output")
WIDE = typer.Option(False, "--wide", help="every column, ids included")


def set_output(flag: bool, wide: bool = False) -> bool:
    """Record ``--json`` and ``--wide`` for :mod:`cli.render`; returns ``--json``."""
    OPTIONS.json = flag
    OPTIONS.wide = wide
    return flag


env_or_fail = target_env
"""The environment ``--env`` names (an id or project/app/env), else a refusal :func:`cli.client.run` prints."""
