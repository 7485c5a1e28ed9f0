"""``zattera cluster init`` / ``cluster status``: the one step that creates the streams, buckets and object
stores and records the cluster configuration, and a read-only check of every stream against it
(docs/cluster.md)."""

from __future__ import annotations

import logging
from dataclasses import asdict

import typer

from cli import render
from cli.client import OPTIONS, ExitCode, connect_cli, err, fail, nats_url, run
from shared.natsio import ProvisionReport, cluster_size, inspect_cluster, placement_log, provision

cluster_app = typer.Typer(no_args_is_help=True, help="The cluster's own configuration: init and status.")

JSON = typer.Option(False, "--json", help="machine-readable output")


class StderrProgress(logging.Handler):
    """Shows on stderr that init is waiting (for servers still joining), so a wait is never silent."""

    def emit(self, record: logging.LogRecord) -> None:
        err.print(record.getMessage(), style="dim", markup=False, highlight=False)


@cluster_app.command("init")
def init(
    replicas: int = typer.Option(
        0, "--replicas", min=0, max=5, help="copies of every stream (default: 3 on 3+ servers, else 1)"
    ),
    json: bool = JSON,
) -> None:
    """Create every stream, bucket and object store and record the configuration, once. Run again, it
    creates only what is missing and changes nothing; a different --replicas is refused, not applied."""
    OPTIONS.json = json

    async def go() -> ProvisionReport:
        conn = await connect_cli()
        try:
            return await provision(conn.js, replicas=replicas or None)
        finally:
            await conn.close()

    progress = StderrProgress()
    placement_log.addHandler(progress)
    placement_log.setLevel(logging.INFO)
    try:
        report = run(go)
    finally:
        placement_log.removeHandler(progress)
    refused = replicas and replicas != report.config.replicas
    if render.json_mode():
        render.emit_json({**asdict(report), "refused": bool(refused)})
    elif report.initialized:
        render.out.print(f"initialised {nats_url()}: replicas={report.config.replicas}")
    else:
        render.out.print(f"already initialised: replicas={report.config.replicas} ({report.config.initialized_at})")
        if report.created:
            render.out.print(f"created what was missing: {', '.join(report.created)}")
    for mismatch in report.mismatches:
        render.out.print(f"[yellow]mismatch (not applied):[/] {mismatch}", highlight=False)
    if refused:
        raise fail(
            f"--replicas {replicas}: the cluster is initialised with replicas={report.config.replicas}; "
            "existing streams are never changed",
            ExitCode.FAILED,
        )


@cluster_app.command("status")
def status(json: bool = JSON) -> None:
    """The recorded configuration, every stream's replicas, leader and peers, and any mismatch."""
    OPTIONS.json = json

    async def go() -> None:
        conn = await connect_cli()
        try:
            config, streams = await inspect_cluster(conn.js)
            servers = cluster_size(conn.nc)
        finally:
            await conn.close()
        if config is None:
            raise fail(
                f"the cluster at {nats_url()} is not initialised: run `zattera cluster init`", ExitCode.NOT_INITIALISED
            )
        mismatches = [m for s in streams for m in s.mismatches]
        if render.json_mode():
            render.emit_json(
                {
                    "config": asdict(config),
                    "servers": servers,
                    "streams": [asdict(s) for s in streams],
                    "mismatches": mismatches,
                }
            )
            return
        render.out.print(
            f"cluster: {servers} server(s); recorded replicas={config.replicas}, live_ttl={config.live_ttl:g}s, "
            f"tombstone_ttl={config.tombstone_ttl:g}s, build_log_lines={config.build_log_lines}"
            f"{f', initialised {config.initialized_at}' if config.initialized_at else ''}",
            highlight=False,
        )
        render.table(
            "streams",
            ["stream", "replicas", "leader", "peers", "matches"],
            [
                [
                    s.name,
                    s.replicas if s.exists else "-",
                    s.leader or "-",
                    ", ".join(s.peers) or "-",
                    "yes" if not s.mismatches else "NO",
                ]
                for s in streams
            ],
        )
        for mismatch in mismatches:
            render.out.print(f"[yellow]mismatch (not applied):[/] {mismatch}", highlight=False)

    run(go)
