"""The proxy process with HAProxy in the data path: :class:`HAProxyIngress` runs an :class:`HAProxyEngine`
(``haproxy_engine.py``) on the routes the Python proxy follows (which still serves what HAProxy hands it:
cold and basic-auth requests), and gives HAProxy the certificates it serves (issued, or from a directory)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.haproxy_config import HOLD_PORT_FILE, Layout
from services.proxy.haproxy_engine import SWEEP_INTERVAL, HAProxyEngine
from services.proxy.haproxy_runtime import RuntimeAPIError
from services.proxy.launch import split_listen
from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared.certclient import CACHE_FILE as CERTS_CACHE_FILE
from shared.certclient import CertClient, ServedCert
from shared.embedded import free_port
from shared.files import write_atomic
from shared.metrics import RequestSeries
from shared.routewire import same_cluster
from shared.settings import settings

log = logging.getLogger(__name__)


def servable(certs: Mapping[str, ServedCert], now: float) -> dict[str, str]:
    """hostname → PEM (chain + key) of the certificates not expired at ``now``."""
    return {host: cert.pem for host, cert in certs.items() if cert.not_after > now}


def _stamps(directory: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in directory.glob("*.pem")} if directory.is_dir() else {}


def _read_pems(directory: Path, names: Mapping[str, float]) -> dict[str, str]:
    return {Path(name).stem: (directory / name).read_text() for name in sorted(names)}


def hold_port(recorded: Path) -> int:
    """The loopback port for the Python handler: the one ``recorded`` names (the previous proxy process's, which
    an HAProxy that outlived it still sends to) while it is free, else a free one; recorded for the next."""
    try:
        port = int(recorded.read_text().strip())
    except (OSError, ValueError):
        port = 0
    if not 0 < port < 65536 or not _bindable(port):
        port = free_port()
    write_atomic(recorded, f"{port}\n", durable=False)  # lost: a new port, which the reload hands HAProxy
    return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the handler's listener binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class HAProxyIngress:
    """The proxy process with ``--engine haproxy``: HAProxy on the public listener, the Python
    :class:`Proxy` on loopback as the hold handler (cold and basic-auth routes), the route client, NATS
    and the heartbeat (HAProxy's per-env samples merged in)."""

    def __init__(
        self, proxy: Proxy, layout: Layout, *, certs_dir: Path | None = None, certs_poll_interval: float = 1.0
    ) -> None:
        self.proxy = proxy
        self.layout = layout
        self.certs_dir = certs_dir
        self.certs_poll_interval = certs_poll_interval
        self.engine = HAProxyEngine(
            layout, node_id=proxy.cfg.node_id, requests=RequestSeries() if proxy.metrics else None
        )
        self._changed = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None
        self._certs_watcher: asyncio.Task[None] | None = None
        self._applied = 0
        self._applied_cluster = cpb.ClusterIdentity()

    @property
    def version(self) -> int:
        """The routes version HAProxy serves."""
        return self._applied

    async def start(self) -> None:
        # Listen before anything can arrive: a snapshot taken while HAProxy starts is applied right after.
        self.proxy.snapshot_listeners.append(lambda _: self._changed.set())
        await self.proxy.start()
        snapshot = self.proxy.routes.current
        await self.engine.start(snapshot)
        self._applied, self._applied_cluster = snapshot.version, snapshot.cluster
        self.proxy.sample_sources.append(self.engine.samples)
        self.proxy.traffic_sources.append(self.engine.release_traffic)
        self.proxy.drain_sources.append(self.engine.old_inflight)
        self.proxy.served = self._served
        self.proxy.public_ports = self._public_ports
        self._follower = asyncio.create_task(self._follow())
        if self.certs_dir is not None and self.layout.tls_bind:
            self._certs_watcher = asyncio.create_task(self._watch_certificates(self.certs_dir))
        elif self.proxy.certificates is not None and self.layout.tls_bind:
            self._certs_watcher = asyncio.create_task(self._serve_issued_certificates(self.proxy.certificates))

    def _served(self) -> tuple[int, cpb.ClusterIdentity]:
        """The routes both data paths serve: HAProxy's and the Python handler's (cold envs, basic auth); while
        they hold snapshots of different clusters, neither cluster's routes are served throughout."""
        table = self.proxy.table
        if not same_cluster(table.cluster, self._applied_cluster):
            return 0, cpb.ClusterIdentity()
        return min(self._applied, table.version), table.cluster

    def _public_ports(self) -> tuple[int, int]:
        """HAProxy's listeners: where clients reach this proxy."""
        tls = self.layout.tls_bind.rpartition(":")[2] if self.layout.tls_bind else "0"
        return int(self.layout.bind.rpartition(":")[2]), int(tls)

    async def _serve_issued_certificates(self, client: CertClient) -> None:
        """The control plane's certificates (docs/certificates.md): the client's 0600 cache at once (so a
        proxy starting with the control plane down serves them), then every set it hands out, swapped in
        through the runtime API. When HAProxy does not take a set (restarting), the client's newest set is
        tried again every second."""
        async for certs in client.updates():
            while True:
                try:
                    await self.engine.set_certificates(servable(certs, time.time()))
                    break
                except (OSError, TimeoutError, RuntimeAPIError) as exc:
                    log.error("haproxy: %d issued certificate(s) not applied yet: %s", len(certs), exc)
                    await asyncio.sleep(SWEEP_INTERVAL)
                    certs = client.current

    async def _watch_certificates(self, directory: Path) -> None:
        """Serve the ``*.pem`` files the controller keeps in ``directory``; changes are applied in place."""
        seen: dict[str, float] = {}
        while True:
            try:
                stamps = await asyncio.to_thread(_stamps, directory)
                if stamps != seen:
                    await self.engine.set_certificates(await asyncio.to_thread(_read_pems, directory, stamps))
                    seen = stamps
            except (OSError, TimeoutError, RuntimeAPIError) as exc:
                log.error("haproxy: certificates in %s not applied: %s", directory, exc)
            await asyncio.sleep(self.certs_poll_interval)

    async def _follow(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            snapshot = self.proxy.routes.current
            try:
                await self.engine.apply(snapshot)
                self._applied, self._applied_cluster = snapshot.version, snapshot.cluster
            except (OSError, TimeoutError, RuntimeError, RuntimeAPIError) as exc:
                # HAProxy is restarting (the supervisor renders the newest routes) or refused the change.
                log.error("haproxy: routes version %d not applied: %s", snapshot.version, exc)
                await asyncio.sleep(SWEEP_INTERVAL)
                self._changed.set()

    async def stop(self) -> None:
        for task in (self._follower, self._certs_watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.engine.stop()
        await self.proxy.stop()


def haproxy_ingress(cfg: ProxySettings, *, nats_url: str, cache_dir: Path, metrics: bool = False) -> HAProxyIngress:
    """HAProxy on ``cfg.host:cfg.port`` (port 0: a free one), the Python hold handler on a loopback port (the
    previous proxy process's while it is free: :func:`hold_port`)."""
    port = cfg.port or free_port()
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    tls_bind = ""
    if cfg.tls_listen:
        tls_host, tls_port = split_listen(cfg.tls_listen)
        tls_bind = f"[{tls_host}]" if ":" in tls_host else tls_host
        tls_bind += f":{tls_port or free_port()}"
    directory = cache_dir / "haproxy"
    hold = hold_port(directory / HOLD_PORT_FILE)
    layout = Layout(
        directory=directory,
        bind=f"{host}:{port}",
        hold_addr=f"127.0.0.1:{hold}",
        hold_timeout=cfg.hold_timeout,
        connect_timeout=cfg.upstream_connect_timeout,
        shutdown_grace=cfg.shutdown_grace,
        header_timeout=cfg.header_timeout,
        tls_bind=tls_bind,
        old_worker_lifetime=settings().drain_window,
        latency_log=cfg.latency_log,
        latency_log_sample=cfg.latency_log_sample,
        latency_log_lines=cfg.latency_log_lines,
    )
    hold_cfg = cfg.model_copy(update={"host": "127.0.0.1", "port": hold, "listen": ""})
    proxy = Proxy(hold_cfg, nats_url=nats_url, cache_dir=cache_dir, metrics=metrics, behind_engine=True)
    if tls_bind and cfg.certs_dir is None:
        proxy.certificates = CertClient(cache_dir / CERTS_CACHE_FILE)
    return HAProxyIngress(proxy, layout, certs_dir=cfg.certs_dir, certs_poll_interval=cfg.certs_poll_interval)
