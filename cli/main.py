"""The ``zattera`` command line."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.up import Cluster, run_up
from shared.settings import settings

app = typer.Typer(no_args_is_help=True, help="Zattera: a self-hosted PaaS control plane on NATS JetStream.")


@app.callback()
def root() -> None:
    """Zattera: a self-hosted PaaS control plane on NATS JetStream."""


@app.command()
def up(
    data_dir: Path = typer.Option(None, help="where NATS data and logs live (default: $ZATTERA_DATA_DIR or .zattera)"),
    port: int = typer.Option(4222, help="NATS client port (a free one is used when busy)"),
) -> None:
    """Start the whole single-machine cluster: embedded NATS and every service, until Ctrl-C."""
    directory = (data_dir or settings().data_dir).resolve()
    raise typer.Exit(run_up(Cluster(data_dir=directory, port=port)))


def main() -> None:
    app()
