"""``zattera cluster init`` / ``status`` / ``upgrade`` / ``replicas``: the one step that creates the streams,
buckets and object stores and records the cluster configuration, a read-only check of every stream against
it, the schema and which version leads each loop (docs/cluster.md), the migrations to this version's schema
run on demand (docs/upgrades.md; the control plane also runs them at start), and every stream moved to N
copies once server machines have joined."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import typer
from google.protobuf.message import DecodeError
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import ExitCode, connect_cli, err, fail, nats_url, run, say
from cli.options import JSON, set_output
from shared.actions.replicas import ChangeReplicas, ReplicasChanged, change_replicas
from shared.connection import Connection
from shared.directget import last_per_subject
from shared.jetstream import is_delete_marker
from shared.lease import default_holder
from shared.migrations.registry import SCHEMA, load
from shared.migrations.runner import MigrationFailed, UpgradeReport, pending_steps, upgrade
from shared.provisioning import (
    ProvisionReport,
    cluster_size,
    inspect_cluster,
    placement_log,
    provision,
    recorded_config,
)
from shared.replicas import DEFAULT_TIMEOUT, StreamChanged
from shared.skew import Component, SkewRefused, judge
from shared.streams import ClusterConfig
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.version import VERSION

cluster_app = typer.Typer(
    no_args_is_help=True, help="The cluster's own configuration: init, status, and upgrades of its schema."
)


class StderrProgress(logging.Handler):
    """Shows on stderr that init is waiting (for servers still joining), so a wait is never silent."""

    def emit(self, record: logging.LogRecord) -> None:
        say(record.getMessage(), style="dim")


@cluster_app.command("init")
def init(
    replicas: int = typer.Option(
        0, "--replicas", min=0, max=5, help="copies of every stream (default: 3 on 3+ servers, else 1)"
    ),
    json: bool = JSON,
) -> None:
    """Create every stream, bucket and object store and record the configuration, once. Run again, it
    creates only what is missing and changes nothing; a different --replicas is refused, not applied."""
    set_output(json)

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
    set_output(json)

    async def go() -> None:
        conn = await connect_cli()
        try:
            config, streams = await inspect_cluster(conn.js)
            servers = cluster_size(conn.nc)
            leaders = await _leaders(conn) if config is not None else []
        finally:
            await conn.close()
        if config is None:
            raise fail(
                f"the cluster at {nats_url()} is not initialised: run `zattera cluster init`", ExitCode.NOT_INITIALISED
            )
        mismatches = [m for s in streams for m in s.mismatches]
        skew = judge(Component.CLI, VERSION, SCHEMA, config.version, config.schema)
        if render.json_mode():
            render.emit_json(
                {
                    "config": asdict(config),
                    "servers": servers,
                    "streams": [asdict(s) for s in streams],
                    "mismatches": mismatches,
                    "leaders": leaders,
                    "cli": {"version": VERSION, "schema": SCHEMA, "skew": skew.verdict.value},
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
        _print_schema(config, leaders)
        if skew.message:
            render.out.print(f"[yellow]{skew.message}[/]", highlight=False)

    run(go)


async def _leaders(conn: Connection) -> list[dict[str, str]]:
    """Each loop's lease: who leads it and that process's version (empty before leases carried one)."""
    found = []
    for msg in await last_per_subject(conn.nc, STATE_STREAM, f"{STATE_PREFIX}lease.>", 5.0):
        if is_delete_marker(msg.headers) or not msg.data:
            continue
        try:
            lease = pb.Lease.FromString(msg.data)
        except DecodeError:
            continue
        # A direct get's answer arrives on the requester's inbox: the key is in its Nats-Subject header.
        subject = (msg.headers or {}).get("Nats-Subject", msg.subject)
        loop = subject.removeprefix(f"{STATE_PREFIX}lease.")
        found.append({"loop": loop, "holder": lease.holder, "version": lease.version})
    return sorted(found, key=lambda leader: leader["loop"])


def _print_schema(config: ClusterConfig, leaders: list[dict[str, str]]) -> None:
    recorded = config.version or "not recorded: 0.1.0 or earlier"
    render.out.print(
        f"schema {config.schema} (Zattera {recorded}); this zattera: {VERSION}, schema {SCHEMA}", highlight=False
    )
    if config.migrations:
        render.table(
            "migrations run", ["migration", "when", "by", "what changed"], [_history(m) for m in config.migrations]
        )
    if leaders:
        render.table(
            "leaders",
            ["loop", "version", "holder"],
            [[leader["loop"], leader["version"] or "0.1.0 or earlier", leader["holder"]] for leader in leaders],
        )


def _history(line: str) -> list[str]:
    return [*line.split(" ", 3), "", "", ""][:4]


@cluster_app.command("upgrade")
def upgrade_cmd(
    dry_run: bool = typer.Option(False, "--dry-run", help="list the pending migrations; change nothing"),
    json: bool = JSON,
) -> None:
    """Bring the cluster to this version's schema now: the pending migrations, in order, each recorded
    (the control plane also runs them when it starts). A cluster at a newer schema is refused."""
    set_output(json)

    async def go() -> dict[str, Any]:
        conn = await connect_cli()
        try:
            config = await recorded_config(conn.js)
            if config is None:
                raise fail(
                    f"the cluster at {nats_url()} is not initialised: run `zattera cluster init`",
                    ExitCode.NOT_INITIALISED,
                )
            steps = load()
            pending = [
                {"migration": s.label, "summary": s.migration.summary, "release": s.migration.release}
                for s in pending_steps(config.schema, steps)
            ]
            skew = judge(Component.CONTROL_PLANE, VERSION, SCHEMA, config.version, config.schema)
            if skew.refused:
                raise fail(skew.message)
            if dry_run:
                return {"dry_run": True, "schema": config.schema, "target": SCHEMA, "pending": pending}
            progress = (lambda line: None) if render.json_mode() else (lambda line: err.print(line, highlight=False))
            try:
                report = await upgrade(conn, holder=default_holder("zattera-cli-upgrade"), progress=progress)
            except (SkewRefused, MigrationFailed) as exc:
                raise fail(str(exc)) from None
            return _report_json(report)
        finally:
            await conn.close()

    result = run(go)
    if render.json_mode():
        render.emit_json(result)
    elif result.get("dry_run"):
        if not result["pending"]:
            render.out.print(f"schema {result['schema']}: up to date (this zattera: {VERSION}, schema {SCHEMA})")
        for step in result["pending"]:
            render.out.print(f"pending: {step['migration']}: {step['summary']} (Zattera {step['release']})")
    elif result["applied"] or result["by_other"]:
        render.out.print(f"cluster at schema {result['after']['schema']} (Zattera {result['after']['version']})")
    else:
        render.out.print(f"nothing to do: schema {result['after']['schema']} (Zattera {result['after']['version']})")


@cluster_app.command("replicas")
def replicas_cmd(
    replicas: int = typer.Argument(..., help="copies of every stream: 1, 3 or 5 (one per server machine)"),
    timeout: float = typer.Option(
        DEFAULT_TIMEOUT, "--timeout", min=1, max=1800, help="seconds one stream's copies may take to catch up"
    ),
    json: bool = JSON,
) -> None:
    """Keep N copies of every stream, bucket and object store (each on another server machine) and record
    N for what is created later: one deliberate step once server machines have joined (docs/cluster.md).
    Stream by stream, the state stream last; streams already at N are skipped, so running it again finishes
    a change cut short."""
    set_output(json)

    def shown(done: StreamChanged) -> None:
        if render.json_mode():
            return
        what = f"{done.before} -> {done.after}" if done.changed else f"already {done.after}"
        err.print(
            f"{done.stream}: {what}, {done.current} caught up on {', '.join(done.servers) or '-'} "
            f"({done.seconds:.1f} s)",
            highlight=False,
            markup=False,
        )

    async def go() -> ReplicasChanged:
        conn = await connect_cli()
        try:
            return await change_replicas(conn.nc, ChangeReplicas(replicas, timeout), shown)
        finally:
            await conn.close()

    result = run(go)
    if render.json_mode():
        render.emit_json(
            {
                "replicas": result.replicas,
                "recorded_before": result.recorded_before,
                "changed": result.changed,
                "streams": [asdict(s) for s in result.streams],
            }
        )
        return
    render.out.print(
        f"every stream at {result.replicas} copies ({result.changed} changed of {len(result.streams)}); "
        f"recorded replicas {result.recorded_before} -> {result.replicas}",
        highlight=False,
    )


def _report_json(report: UpgradeReport) -> dict[str, Any]:
    return {
        "before": {"schema": report.before.schema, "version": report.before.version},
        "after": {"schema": report.after.schema, "version": report.after.version},
        "applied": [asdict(a) for a in report.applied],
        "by_other": report.by_other,
    }


def _retire_seats_command() -> None:
    from cli.machine_cmds import cluster_retire_seats  # the machine commands' imports, only with this command

    cluster_app.command("retire-seats")(cluster_retire_seats)


_retire_seats_command()
