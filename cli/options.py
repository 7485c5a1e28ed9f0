"""Options and lookups that several command groups share."""

from __future__ import annotations

import typer

from cli.render import set_output as set_output  # re-exported: every command group sets its output here
from shared.actions.names import target_env

JSON = typer.Option(False, "--json", help="machine-readable output")
WIDE = typer.Option(False, "--wide", help="every column, ids included")


env_or_fail = target_env
"""The environment ``--env`` names (an id or project/app/env), else a refusal :func:`cli.client.run` prints."""
