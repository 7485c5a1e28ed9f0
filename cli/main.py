"""The ``zattera`` command line: the operator interface.

Every read command accepts ``--json``; every write goes through the fenced-write layer. This module assembles
the app from the command groups (``cli/*_cmds.py``, one module per group) and holds ``zattera up``.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from cli.apps_cmds import apps_app
from cli.build_cmds import build_app
from cli.builds_cmds import builds_app
from cli.client import OPTIONS
from cli.cluster_cmds import cluster_app
from cli.config_cmds import config_app
from cli.console_cmds import console_app
from cli.context_cmds import context_app
from cli.deploy_cmds import deploy_app, releases, rollback
from cli.domains_cmds import domains_app
from cli.env_cmds import envs_app, projects_app, scale, status
from cli.events_cmds import events
from cli.images_cmds import images_app
from cli.inspect_cmds import ps, routes
from cli.jobs_cmds import jobs_app, run_command
from cli.layout import DataLayout
from cli.logs_cmds import logs
from cli.machine_cmds import machine_up
from cli.network_cmds import network
from cli.nodes_cmds import nodes_app
from cli.registry_cmds import registry_app
from cli.secrets_cmds import secrets_app
from cli.security_cmds import secure_up, security_app
from cli.up import DEFAULT_METRICS_PORT, Cluster, request_roll, run_up, running_supervisor
from cli.volumes_cmds import volumes_app
from services.proxy.launch import DEFAULT_HOST as DEFAULT_PROXY_HOST
from services.proxy.launch import DEFAULT_TLS_LISTEN as DEFAULT_PROXY_TLS_LISTEN
from services.proxy.launch import split_listen
from shared.settings import settings
from shared.telemetry import setup as setup_telemetry
from shared.version import zattera_version

app = typer.Typer(no_args_is_help=True, help="Zattera: a self-hosted PaaS control plane on NATS JetStream.")
app.add_typer(deploy_app, name="deploy")
app.add_typer(nodes_app, name="nodes")
app.add_typer(apps_app, name="apps")
app.add_typer(builds_app, name="builds")
app.add_typer(build_app, name="build")
app.add_typer(volumes_app, name="volumes")
app.add_typer(security_app, name="security")
app.add_typer(config_app, name="config")
app.add_typer(secrets_app, name="secrets")
app.add_typer(domains_app, name="domains")
app.command("logs")(logs)
app.command()(events)
app.add_typer(cluster_app, name="cluster")
app.add_typer(context_app, name="context")
app.add_typer(jobs_app, name="jobs")
app.command("network")(network)
app.command("run", context_settings={"allow_interspersed_args": False})(run_command)

app.add_typer(images_app, name="images")
app.add_typer(console_app, name="console")
app.add_typer(registry_app, name="registry")


def print_version(asked: bool) -> None:
    if asked:
        print(f"zattera {zattera_version()}")
        raise typer.Exit()


@app.callback()
def root(
    nats: str = typer.Option("", "--nats", envvar="ZATTERA_NATS_URL", help="NATS URL(s), comma-separated"),
    version: bool = typer.Option(
        False, "--version", callback=print_version, is_eager=True, help="print the installed version and exit"
    ),
) -> None:
    """Zattera: a self-hosted PaaS control plane on NATS JetStream."""
    OPTIONS.nats_url = nats
    setup_telemetry("zattera-cli")  # OTEL_TRACES_EXPORTER picks the exporter; unset = no-op


# ---------------------------------------------------------------------------------------------- cluster


@app.command()
def up(
    data_dir: Path = typer.Option(None, help="where NATS data and logs live (default: $ZATTERA_DATA_DIR or .zattera)"),
    port: int = typer.Option(4222, help="NATS client port (a free one is used when busy)"),
    secure: bool = typer.Option(False, help="NATS accounts and per-role credentials (SECURITY.md)"),
    tls: bool = typer.Option(False, help="TLS on the NATS listener with a generated local CA (implies --secure)"),
    nats_cluster: int = typer.Option(
        1, "--nats-cluster", min=1, max=5, help="local NATS servers as one JetStream cluster (3: replicas=3)"
    ),
    proxy_port: int = typer.Option(8080, help="HTTP port of the local ingress proxy"),
    proxy_listen: str = typer.Option(
        "",
        "--proxy-listen",
        envvar="ZATTERA_PROXY_LISTEN",
        help="HOST:PORT of the local ingress proxy (default 0.0.0.0:<proxy-port>: every interface)",
    ),
    proxy_tls_listen: str = typer.Option(
        DEFAULT_PROXY_TLS_LISTEN,
        "--proxy-tls-listen",
        envvar="ZATTERA_PROXY_TLS_LISTEN",
        help="HOST:PORT of the proxy's HTTPS listener (haproxy engine; certificates: docs/certificates.md); '' = none",
    ),
    node: bool = typer.Option(True, "--node/--no-node", help="also run a local agent and the proxy"),
    all_in_one: bool = typer.Option(
        True, "--all-in-one/--separate", help="the control plane in one process, or one process per service"
    ),
    metrics_port: int = typer.Option(
        DEFAULT_METRICS_PORT, min=0, max=65535, help="Prometheus metrics from this port up, one per process; 0 = off"
    ),
    allow_unisolated_apps: bool = typer.Option(
        False,
        "--allow-unisolated-apps",
        help="with --secure on a machine that cannot sandbox apps: run them anyway, able to read the node's"
        " files and credential (SECURITY.md)",
    ),
    join: str = typer.Option(
        "", "--join", help="join a cluster with a token of `zattera nodes join-token` (docs/cluster.md)"
    ),
    server: bool = typer.Option(False, "--server", help="with --join: a server machine (NATS, control plane, node)"),
    name: str = typer.Option("", "--name", help="this machine's node id (several machines: docs/cluster.md)"),
    advertise: str = typer.Option("", "--advertise", help="the address other machines reach this one at"),
) -> None:
    """Start the whole single-machine cluster: embedded NATS and every service, until Ctrl-C. With --name and
    --advertise, the first machine of a cluster of machines; with --join TOKEN, another one. Run while it
    runs (after `git pull`), it rolls the running processes onto the code installed now, apps untouched."""
    directory = (data_dir or settings().data_dir).resolve()
    running = running_supervisor(directory)
    if running is not None:
        raise typer.Exit(request_roll(directory, running))
    layout = DataLayout(directory)
    for line in layout.migrate():
        typer.echo(f"data dir: {line}", err=True)
    if node and (secure or tls or server or (advertise and not join)):  # a secured node that builds
        refuse_unisolated(allow=allow_unisolated_apps)
    if allow_unisolated_apps:  # the local agent gets it with the rest of this environment
        os.environ["ZATTERA_AGENT_ALLOW_UNISOLATED"] = "1"
    if join or advertise:
        raise typer.Exit(machine_up(directory, join, server=server, name=name, advertise=advertise, tls=tls))
    proxy_host = DEFAULT_PROXY_HOST
    if proxy_listen:
        try:
            proxy_host, proxy_port = split_listen(proxy_listen)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy-listen") from None
    if proxy_tls_listen:
        try:
            tls_host, tls_port = split_listen(proxy_tls_listen)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy-tls-listen") from None
        if proxy_tls_listen == DEFAULT_PROXY_TLS_LISTEN and proxy_host != tls_host:
            # --proxy-listen 127.0.0.1:… keeps the proxy on this machine: HTTPS too, unless told otherwise.
            proxy_tls_listen = f"[{proxy_host}]:{tls_port}" if ":" in proxy_host else f"{proxy_host}:{tls_port}"
    if secure or tls:
        raise typer.Exit(
            secure_up(
                directory,
                port,
                tls=tls,
                proxy_port=proxy_port,
                proxy_host=proxy_host,
                proxy_tls_listen=proxy_tls_listen,
                with_node=node,
                metrics_port=metrics_port,
                all_in_one=all_in_one,
                nats_cluster=nats_cluster,
            )
        )
    cluster = Cluster(
        data_dir=directory,
        port=port,
        nats_cluster=nats_cluster,
        proxy_port=proxy_port,
        proxy_host=proxy_host,
        proxy_tls_listen=proxy_tls_listen,
        with_node=node,
        metrics_port=metrics_port,
        all_in_one=all_in_one,
    )
    raise typer.Exit(run_up(cluster))


def refuse_unisolated(*, allow: bool) -> None:
    """A secured ``zattera up`` on a machine that cannot sandbox apps stops here, with the reason and status 2,
    before starting anything (its agent, a builder, would refuse to run anyway: SECURITY.md "Apps"), unless
    ``--allow-unisolated-apps``. A joining worker's agent decides for itself (its containers may isolate
    its apps)."""
    from services.agent.sandbox import IsolationRefused, Support, decide_isolation, probe_now
    from services.agent.settings import AgentSettings

    cfg = AgentSettings()
    support = probe_now(cfg.sandbox_bwrap) if cfg.sandbox != "off" else Support(problem="turned off")
    try:
        decide_isolation(
            runtime="process", mode=cfg.sandbox, support=support, secured=True, allow_unisolated=allow, what="apps"
        )
    except IsolationRefused as exc:
        typer.echo(f"error: zattera up: {exc}", err=True)
        raise typer.Exit(2) from None


# The order of registration is the order of `zattera --help`.
app.command()(rollback)
app.command()(releases)
app.command()(ps)
app.command()(routes)
# Issue 21: operating environments (cli/env_cmds.py).
app.command("status")(status)
app.command("scale")(scale)
app.add_typer(envs_app, name="envs")
app.add_typer(projects_app, name="projects")


def main() -> None:
    app()


__all__ = ["app", "main"]
