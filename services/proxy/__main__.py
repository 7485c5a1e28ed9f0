"""``python -m services.proxy --nats URL --port 8080 --proxy-id ID --node-id ID --cache-dir DIR``.

Settings come from ``ZATTERA_*`` (NATS URL, data dir) and ``ZATTERA_PROXY_*`` (see
:class:`services.proxy.settings.ProxySettings`); flags override them. SIGTERM/SIGINT stop accepting,
drain in-flight requests for ``shutdown_grace`` seconds, then exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from services.proxy.haproxy_engine import HAProxyIngress, haproxy_ingress
from services.proxy.launch import choose_engine
from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared.metrics import add_metrics_argument, metrics_port, serve_metrics
from shared.service import configure_logging
from shared.settings import settings
from shared.telemetry import setup as setup_telemetry

log = logging.getLogger("services.proxy")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.proxy", description="Zattera ingress proxy")
    parser.add_argument("--nats", default=None, help="NATS URL(s), comma-separated (default: $ZATTERA_NATS_URL)")
    parser.add_argument(
        "--listen", default=None, help="HOST:PORT to listen on (default: $ZATTERA_PROXY_LISTEN or 0.0.0.0:8080)"
    )
    parser.add_argument("--host", default=None, help="listen address (default: $ZATTERA_PROXY_HOST or 0.0.0.0)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default: $ZATTERA_PROXY_PORT or 8080)")
    parser.add_argument("--proxy-id", default=None, help="heartbeat key (default: the host name)")
    parser.add_argument("--node-id", default=None, help="node this proxy runs on")
    parser.add_argument("--cache-dir", type=Path, default=None, help="route cache dir (default: <data_dir>/proxy)")
    parser.add_argument(
        "--engine",
        choices=["python", "haproxy"],
        default=None,
        help="data plane (default: $ZATTERA_PROXY_ENGINE, else haproxy when installed, else python)",
    )
    parser.add_argument(
        "--tls-listen",
        default=None,
        help="haproxy engine: HOST:PORT of the TLS listener (SNI, h2); it serves the control plane's certificates "
        "(ACME, local CA) unless --certs-dir is given",
    )
    parser.add_argument(
        "--certs-dir",
        type=Path,
        default=None,
        help="haproxy engine: serve the <name>.pem files (chain + key) of this directory instead",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_metrics_argument(parser)
    return parser.parse_args(argv)


async def run(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    setup_telemetry("zattera-proxy")
    shared = settings()
    port = metrics_port(args.metrics_port, shared.metrics_port)
    metrics_on = serve_metrics("zattera-proxy", port, shared.metrics_host) is not None
    overrides = {
        name: value
        for name, value in (
            ("listen", args.listen),
            ("host", args.host),
            ("port", args.port),
            ("proxy_id", args.proxy_id),
            ("node_id", args.node_id),
            ("cache_dir", args.cache_dir),
            ("engine", args.engine),
            ("tls_listen", args.tls_listen),
            ("certs_dir", args.certs_dir),
        )
        if value is not None
    }
    if args.listen is None and (args.host is not None or args.port is not None):
        overrides["listen"] = ""  # --host/--port given: they beat $ZATTERA_PROXY_LISTEN
    try:
        cfg = ProxySettings(**overrides)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "listen"
            log.error("proxy: %s: %s", where, error["msg"].removeprefix("Value error, "))
        return 2
    cache_dir = cfg.cache_dir or shared.data_dir / "proxy"
    engine = choose_engine(cfg.engine)
    if engine is None:
        log.error("proxy: --engine haproxy: haproxy is not installed (make system-packages installs it)")
        return 2
    service: Proxy | HAProxyIngress
    if engine == "haproxy":
        service = haproxy_ingress(cfg, nats_url=args.nats or shared.nats_url, cache_dir=cache_dir, metrics=metrics_on)
    else:
        if cfg.tls_listen:
            log.warning("proxy: no TLS listener on %s: TLS needs the haproxy engine (HTTP only)", cfg.tls_listen)
        service = Proxy(cfg, nats_url=args.nats or shared.nats_url, cache_dir=cache_dir, metrics=metrics_on)
    log.info("proxy: data plane %s", engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        log.error("proxy: the %s data plane did not start: %s", engine, exc)
        await service.stop()
        return 1
    try:
        await stop.wait()
        log.info("proxy: stopping (draining for up to %.1fs)", cfg.shutdown_grace)
    finally:
        await service.stop()
    log.info("proxy: stopped")
    return 0


def main() -> None:
    sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
