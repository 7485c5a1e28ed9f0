"""``zattera up``: its options and what it decides before starting (the supervisor itself is :mod:`cli.up`,
secured clusters :mod:`cli.security_cmds`, machines of a cluster :mod:`cli.machine_cmds`)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from cli.layout import DataLayout
from cli.machine import Machine
from cli.machine_cmds import machine_up
from cli.security_cmds import mode_switch_problem, secure_up
from cli.up import run_up
from cli.up_cluster import DEFAULT_METRICS_PORT, Cluster
from cli.up_roll import request_roll, running_supervisor
from services.proxy.launch import DEFAULT_HOST as DEFAULT_PROXY_HOST
from services.proxy.launch import DEFAULT_TLS_LISTEN as DEFAULT_PROXY_TLS_LISTEN
from services.proxy.launch import split_listen
from shared.settings import settings


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
    if nats_cluster == 1 and not join and (problem := mode_switch_problem(layout, secure=secure or tls)):
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)
    if node and (secure or tls or server or (advertise and not join)):  # a secured node that builds
        refuse_unisolated(allow=allow_unisolated_apps)
    if allow_unisolated_apps:  # the local agent gets it with the rest of this environment
        os.environ["ZATTERA_AGENT_ALLOW_UNISOLATED"] = "1"
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
    # A machine of a cluster of machines (a data dir holding machine.json resumes it, with no flag to repeat):
    # its proxy and metrics as asked.
    if join or advertise or Machine.load(directory) is not None:
        options = {
            "proxy_port": proxy_port,
            "proxy_host": proxy_host,
            "proxy_tls_listen": proxy_tls_listen,
            "metrics_port": metrics_port,
        }
        raise typer.Exit(
            machine_up(directory, join, server=server, name=name, advertise=advertise, tls=tls, options=options)
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
    if secure or tls:
        raise typer.Exit(secure_up(cluster, tls=tls))
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
