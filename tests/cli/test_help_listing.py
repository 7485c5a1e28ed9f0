"""``zattera --help`` and every group's help list each command with its summary on one line: typer's rich
listing would keep a docstring's line breaks there, breaking a summary mid-sentence."""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.testing import CliRunner

from cli.app import COMMANDS
from cli.main import app


def _summary(command: Any) -> str:
    """The first paragraph of a command's help, on one line."""
    return " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].split())


def _listed(args: list[str]) -> str:
    return CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "1000"}, prog_name="zattera").output


def test_every_listing_shows_each_summary_unbroken() -> None:
    root = typer.main.get_command(app)
    ctx = root.make_context("zattera", [], resilient_parsing=True)
    listings = {(): (_listed([]), [root.get_command(ctx, name) for name in COMMANDS])}
    for name in COMMANDS:
        group = root.get_command(ctx, name)
        if getattr(group, "commands", None):
            listings[(name,)] = (_listed([name]), [c for c in group.commands.values() if not c.hidden])
    checked = 0
    for args, (out, commands) in listings.items():
        for command in commands:
            summary = _summary(command)
            if summary and "[" not in summary:  # rich markup would be rendered, not shown
                assert summary in out, (args, command.name)
                checked += 1
    assert len(listings) > 10 and checked > 100


def test_a_wrapped_docstring_reads_as_one_sentence() -> None:
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250"}, prog_name="zattera").output
    assert "the address apps reach each at, its ports, and the other projects' envs each may reach." in out
