"""``python -m services.proxy --nats URL --port 8080 --proxy-id ID --node-id ID --cache-dir DIR``.

Settings come from ``ZATTERA_*`` (NATS URL, data dir) and ``ZATTERA_PROXY_*`` (see
:class:`services.proxy.settings.ProxySettings`); flags override them. SIGTERM/SIGINT stop accepting,
drain in-flight requests for ``shutdown_grace`` seconds, then exit.
"""

from __future__ import annotations

from shared.lean import import_nats, settle_soon

import_nats()  # before anything loads nats-py: without aiohttp (PERFORMANCE.md "A lighter node")

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from services.proxy.haproxy_ingress import HAProxyIngress, haproxy_ingress
from services.proxy.launch import choose_engine
from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared.process import Process, run_process

log = logging.getLogger("services.proxy")


def proxy_arguments(parser: argparse.ArgumentParser) -> None:
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


async def run_proxy(process: Process) -> int:
    args = process.args
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
    cache_dir = cfg.cache_dir or process.settings.data_dir / "proxy"
    engine = choose_engine(cfg.engine)
    if engine is None:
        log.error("proxy: --engine haproxy: haproxy is not installed (make system-packages installs it)")
        return 2
    service: Proxy | HAProxyIngress
    if engine == "haproxy":
        service = haproxy_ingress(cfg, nats_url=process.nats_url, cache_dir=cache_dir, metrics=process.metrics)
    else:
        if cfg.tls_listen:
            log.warning("proxy: no TLS listener on %s: TLS needs the haproxy engine (HTTP only)", cfg.tls_listen)
        service = Proxy(cfg, nats_url=process.nats_url, cache_dir=cache_dir, metrics=process.metrics)
    log.info("proxy: data plane %s", engine)
    try:
        await service.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        log.error("proxy: the %s data plane did not start: %s", engine, exc)
        await service.stop()
        return 1
    settle_soon()
    try:
        await process.supervise([])  # the data plane keeps its own connection: only a signal stops it
        log.info("proxy: draining for up to %.1fs", cfg.shutdown_grace)
    finally:
        await process.shut_down(service.stop, grace=None)  # the drain is bounded by shutdown_grace
    return 0


async def run(argv: Sequence[str] | None = None) -> int:
    return await run_process(
        "proxy",
        run_proxy,
        argv,
        prog="python -m services.proxy",
        description="Zattera ingress proxy",
        arguments=proxy_arguments,
    )


def main() -> None:
    sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
