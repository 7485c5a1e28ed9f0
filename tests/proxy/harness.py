"""Real pieces for the proxy tests: tiny aiohttp upstreams, route snapshots published on the real subject
with the route client's wire format, proxies started on a free port with short timers (in this process, or as
the real ``python -m services.proxy``), and the heartbeats they report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy.server import Proxy
from services.proxy.settings import ProxySettings
from shared.connection import Connection
from shared.live import proxy_key
from shared.routewire import content_digest, encode_messages
from shared.subjects import LIVE_BUCKET, ROUTES_SNAPSHOT_SUBJECT
from tests.waiting import eventually

HOST = "app.example.com"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Backend:
    """An upstream that answers ``name`` (or echoes the request), counting hits; while ``gate`` is set
    to an unset event, requests wait on it (to keep them in flight)."""

    name: str
    gate: asyncio.Event | None = None
    hits: int = 0
    inflight: int = 0
    seen: list[web.Request] = field(default_factory=list)
    addr: str = ""
    peers: set[object] = field(default_factory=set)
    """The client ends (address, port) of the connections requests arrived on: one per backend connection."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.seen.append(request)
        if request.transport is not None:
            self.peers.add(request.transport.get_extra_info("peername"))
        self.inflight += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if request.path == "/echo":
                body = await request.read()
                headers = {f"Seen-{k}": v for k, v in request.headers.items()}
                return web.Response(body=body, headers=headers)
            if request.path == "/stream":
                response = web.StreamResponse(headers={"Connection": "close, X-Hop", "X-Hop": "h"})
                await response.prepare(request)
                for index in range(5):
                    await response.write(f"chunk{index};".encode())
                await response.write_eof()
                return response
            if request.path == "/truncated":
                response = web.StreamResponse(headers={"Content-Length": "100"})
                await response.prepare(request)
                await response.write(b"x" * 10)
                assert request.transport is not None
                request.transport.close()
                return response
            return web.Response(text=self.name)
        finally:
            self.inflight -= 1


@contextlib.asynccontextmanager
async def serving(*backends: Backend) -> AsyncIterator[None]:
    runners: list[web.AppRunner] = []
    try:
        for backend in backends:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", backend.handle)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            backend.addr = f"127.0.0.1:{runner.addresses[0][1]}"
            runners.append(runner)
        yield
    finally:
        for backend in backends:
            if backend.gate is not None:
                backend.gate.set()
        for runner in runners:
            await runner.cleanup()


async def keep_alive_requests(url: str, host: str, count: int) -> list[int]:
    """The statuses of ``count`` requests sent one after the other on one keep-alive client connection."""
    statuses = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
        for _ in range(count):
            async with client.get(url, headers={"Host": host}) as response:
                await response.read()
                statuses.append(response.status)
    return statuses


def endpoint(addr: str, assignment_id: str = "", *, node_id: str = "n1", healthy: bool = True) -> cpb.Endpoint:
    return cpb.Endpoint(assignment_id=assignment_id or f"a-{addr}", node_id=node_id, addr=addr, healthy=healthy)


def http_route(
    host: str = HOST,
    env_id: str = "e1",
    endpoints: Sequence[cpb.Endpoint] = (),
    *,
    prefix: str = "",
    scale_to_zero: bool = False,
    max_concurrency: int = 0,
    rate_limit: pb.RateLimit | None = None,
    middleware: pb.Middleware | None = None,
) -> cpb.HTTPRoute:
    route = cpb.HTTPRoute(
        hostname=host,
        path_prefix=prefix,
        environment_id=env_id,
        endpoints=list(endpoints),
        scale_to_zero=scale_to_zero,
        max_concurrency=max_concurrency,
    )
    if rate_limit is not None:
        route.rate_limit.CopyFrom(rate_limit)
    if middleware is not None:
        route.middleware.CopyFrom(middleware)
    return route


class Routes:
    """Publishes snapshots with increasing versions, as a route builder would."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.version = 0

    def snapshot(self, *routes: cpb.HTTPRoute) -> cpb.RouteSnapshot:
        self.version += 1
        return cpb.RouteSnapshot(version=self.version, http_routes=list(routes))

    async def publish(self, *routes: cpb.HTTPRoute) -> int:
        snap = self.snapshot(*routes)
        data = snap.SerializeToString(deterministic=True)
        for message in encode_messages(
            data, version=snap.version, digest=content_digest(data), max_message_bytes=1 << 20
        ):
            await self.conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
        await self.conn.nc.flush()
        return snap.version

    async def serve(self, proxy: Proxy, *routes: cpb.HTTPRoute) -> None:
        """Publish and wait until ``proxy`` routes with the new snapshot."""
        version = await self.publish(*routes)
        await eventually(lambda: proxy.table.version == version, 5, f"proxy on routes version {version}")


ProxyFactory = Callable[..., Awaitable[Proxy]]


def settings(**overrides: Any) -> ProxySettings:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "proxy_id": "p1",
        "node_id": "n1",
        "heartbeat_interval": 0.1,
        "shutdown_grace": 1.0,
    }
    return ProxySettings(**{**base, **overrides})


async def start_proxy(nats_url: str, cache_dir: Path, *, connected: bool = True, **overrides: Any) -> Proxy:
    proxy = Proxy(settings(**overrides), nats_url=nats_url, cache_dir=cache_dir)
    await proxy.start()
    if connected:
        await asyncio.wait_for(proxy.wait_connected(), 10)
    return proxy


@contextlib.asynccontextmanager
async def dying_upstream() -> AsyncIterator[str]:
    """An upstream (its address yielded) whose replica dies under the first request it gets: the connection
    is closed without an answer and the port stops listening (a replica cooled or scaled down a moment ago).
    Connections that send no request (a health check) are let go."""
    server: asyncio.Server | None = None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        assert server is not None
        server.close()
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def haproxy_pids(under: Path) -> list[int]:
    """The HAProxy processes running (zombies left out) whose command line names a path under ``under``."""
    prefix = f"{under}/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [arg.decode(errors="replace") for arg in (entry / "cmdline").read_bytes().split(b"\0")[:-1]]
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and argv and Path(argv[0]).name == "haproxy" and any(prefix in arg for arg in argv[1:]):
            found.append(int(entry.name))
    return found


def kill_haproxy_under(under: Path) -> list[int]:
    """SIGKILL every HAProxy whose command line names a path under ``under`` (it outlives the process that
    started it: only a clean stop ends it); returns their pids."""
    pids = haproxy_pids(under)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def proxy_flags(nats_url: str, port: int, cache_dir: Path, *, engine: str, proxy_id: str, node_id: str) -> list[str]:
    """The flags of a proxy process with ``engine`` on 127.0.0.1:``port``, its identity and its cache directory."""
    return [
        *("--engine", engine),
        *("--nats", nats_url),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--proxy-id", proxy_id, "--node-id", node_id),
        *("--cache-dir", str(cache_dir)),
    ]


async def proxy_module(
    *args: str, env: dict[str, str] | None = None, output: IO[bytes] | int | None = None
) -> asyncio.subprocess.Process:
    """``python -m services.proxy ARGS`` from the project root, with PATH and ``env`` alone as its environment;
    its stdout and stderr both go to ``output`` (None: inherited)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.proxy",
        *args,
        cwd=PROJECT_ROOT,
        env={"PATH": "/usr/sbin:/usr/bin:/bin", **(env or {})},
        stdout=output,
        stderr=output,
    )


async def last_heartbeat(conn: Connection, proxy_id: str = "p1") -> cpb.ProxyHeartbeat:
    """The newest heartbeat of the proxy ``proxy_id`` (the KV raises when it has none)."""
    live = await conn.js.key_value(LIVE_BUCKET)
    entry = await live.get(proxy_key(proxy_id))
    return cpb.ProxyHeartbeat.FromString(entry.value or b"")


async def first_heartbeat(conn: Connection, proxy_id: str, timeout: float = 30.0) -> cpb.ProxyHeartbeat:
    """Waits until the proxy ``proxy_id`` heartbeats (connected, so subscribed to the routes); that heartbeat."""
    seen: list[cpb.ProxyHeartbeat] = []

    async def reporting() -> bool:
        try:
            beat = await last_heartbeat(conn, proxy_id)
        except Exception:
            return False
        seen.append(beat)
        return beat.proxy_id == proxy_id

    await eventually(reporting, timeout, f"the heartbeat of proxy {proxy_id}")
    return seen[-1]
