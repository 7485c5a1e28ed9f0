"""``zattera up``: its options (the supervisor itself is :mod:`cli.up`, secured clusters :mod:`cli.security_cmds`)."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.up import DEFAULT_METRICS_PORT, Cluster, run_up
from services.proxy.launch import DEFAULT_HOST as DEFAULT_PROXY_HOST
from services.proxy.launch import DEFAULT_TLS_LISTEN as DEFAULT_PROXY_TLS_LISTEN
from services.proxy.launch import split_listen


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
) -> None:
    """Start the whole single-machine cluster: embedded NATS and every service, until Ctrl-C."""
    from cli.security_cmds import mode_switch_problem, secure_up
    from shared.settings import settings

    directory = (data_dir or settings().data_dir).resolve()
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
    if (secure or tls) and nats_cluster > 1:
        raise typer.BadParameter("--secure/--tls run one NATS server; drop --nats-cluster", param_hint="--nats-cluster")
    if nats_cluster == 1 and (problem := mode_switch_problem(directory, secure=secure or tls)):
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)
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
