"""HAProxy outlives a crash of the proxy process (``--engine haproxy``): the real ``python -m services.proxy`` is
SIGKILLed while a client sends requests, and started again; the next one adopts the HAProxy left running (no
request refused or failed, the same master, driven: a route published afterwards is served). A stale pid file
(a dead pid, a live process that is no HAProxy, another directory's HAProxy) is not adopted, and a clean stop
leaves no HAProxy behind."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import bcrypt
import pytest
from zattera.v1 import types_pb2 as pb

from services.proxy.haproxy_config import Layout
from services.proxy.haproxy_ingress import HAProxyIngress, haproxy_ingress
from services.proxy.haproxy_process import command_line, master_processes, runs_layout
from services.proxy.haproxy_runtime import ask
from services.proxy.launch import haproxy_binary
from shared.connection import Connection
from shared.embedded import free_port
from tests.proxy.harness import (
    HOST,
    Backend,
    Routes,
    endpoint,
    first_heartbeat,
    haproxy_pids,
    http_route,
    proxy_flags,
    proxy_module,
    serving,
    settings,
)
from tests.waiting import eventually

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (make system-packages)")

SECOND = "second.example.com"
AUTH = "auth.example.com"


def layout_of(cache_dir: Path) -> Layout:
    """Where the proxy with ``cache_dir`` keeps HAProxy's files (its pid file, its master socket)."""
    return Layout(cache_dir / "haproxy", "", "", 0.0, 0.0)


async def master_is(layout: Layout, pid: int) -> bool:
    """Whether the master CLI gives ``pid`` as the master's (it does not answer while the master re-executes
    itself for a reload)."""
    try:
        return master_processes(await ask(layout.master_socket, "show proc", timeout=5))[0] == pid
    except (OSError, TimeoutError):
        return False


def fresh() -> aiohttp.ClientSession:
    """A client opening a connection per request (an old worker never answers after a reload)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def answers(client: aiohttp.ClientSession, port: int, host: str, body: str) -> bool:
    try:
        async with client.get(f"http://127.0.0.1:{port}/", headers={"Host": host}) as response:
            return response.status == 200 and await response.text() == body
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


class Load:
    """Requests to ``host`` (with ``headers``) one after the other, each on a new connection (a refused one
    shows), answered by the backend ``first``: counts the answers and keeps every failure."""

    def __init__(self, port: int, host: str = HOST, headers: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}/"
        self.headers = {"Host": host, **(headers or {})}
        self.ok = 0
        self.failures: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Load:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True)
        # 30 s: a request for the proxy process's handler waits in HAProxy (up to 10 s) while it restarts.
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as client:
            while True:
                try:
                    async with client.get(self.url, headers=self.headers) as response:
                        body = await response.text()
                    if response.status == 200 and body == "first":
                        self.ok += 1
                    else:
                        self.failures.append(f"{response.status} {body[:100]}")
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    self.failures.append(repr(exc))
                await asyncio.sleep(0.002)  # pacing (~300 requests/s at most): the machine is shared

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def answered(self, more: int, what: str, timeout: float = 30.0) -> None:
        """Until ``more`` requests more than now are answered."""
        target = self.ok + more
        await eventually(lambda: self.ok >= target, timeout, what)


@contextlib.asynccontextmanager
async def proxy_process(
    nats_url: str, port: int, cache_dir: Path, proxy_id: str, log: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m services.proxy --engine haproxy`` on ``port``, its output in ``log``; killed if still running."""
    flags = proxy_flags(nats_url, port, cache_dir, engine="haproxy", proxy_id=proxy_id, node_id="n1")
    with log.open("ab") as output:
        process = await proxy_module(*flags, env={"ZATTERA_PROXY_HEARTBEAT_INTERVAL": "0.2"}, output=output)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_proxy_killed_under_load_leaves_haproxy_serving_and_the_next_one_adopts_it(
    nats_url: str, conn: Connection, routes: Routes, tmp_path: Path
) -> None:
    first, second = Backend("first"), Backend("second")
    port = free_port()
    cache = tmp_path / "cache"
    layout = layout_of(cache)
    after_log = tmp_path / "after.log"
    async with (
        serving(first, second),
        fresh() as client,
        proxy_process(nats_url, port, cache, "before", tmp_path / "before.log") as before,
    ):
        await first_heartbeat(conn, "before")
        await routes.publish(http_route(HOST, "e1", [endpoint(first.addr)]))
        await eventually(lambda: answers(client, port, HOST, "first"), 30, "the route served")
        await eventually(lambda: (cache / "routes.pb").exists(), 10, "the routes cached")
        master = int(layout.pid_file.read_text())
        assert runs_layout(command_line(master), layout, "haproxy")
        load = Load(port).start()
        try:
            await load.answered(50, "requests through the first proxy")
            before.kill()
            assert await asyncio.wait_for(before.wait(), 10) == -signal.SIGKILL
            await load.answered(200, "requests answered while no proxy process runs")
            assert load.failures == []
            assert haproxy_pids(cache) and master in haproxy_pids(cache)  # the master outlived its parent

            async with proxy_process(nats_url, port, cache, "after", after_log) as after:
                adopted = f"haproxy: adopted pid {master} "
                await eventually(lambda: adopted in after_log.read_text(), 60, "the next proxy adopts HAProxy")
                await first_heartbeat(conn, "after")
                await load.answered(100, "requests answered after the adoption")
                await routes.publish(
                    http_route(HOST, "e1", [endpoint(first.addr)]),
                    http_route(SECOND, "e2", [endpoint(second.addr)]),
                )
                await eventually(lambda: answers(client, port, SECOND, "second"), 30, "a route added afterwards")
                await load.answered(100, "requests answered after the route change")
                await load.stop()
                sent = load.ok + len(load.failures)
                assert load.failures == [], f"{len(load.failures)} of {sent} failed: {load.failures[:5]}"
                assert int(layout.pid_file.read_text()) == master
                await eventually(lambda: master_is(layout, master), 10, "the same master, driven by the new proxy")
                assert "haproxy: pid " not in after_log.read_text()  # no second HAProxy was started
                after.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(after.wait(), 20) == 0
        finally:
            await load.stop()
    await eventually(lambda: haproxy_pids(tmp_path) == [], 10, "no HAProxy left after a clean stop")
    assert not layout.pid_file.exists()


async def test_requests_the_proxy_process_answers_wait_for_the_next_one(
    nats_url: str, conn: Connection, routes: Routes, tmp_path: Path
) -> None:
    """A basic-auth route is served by the proxy process's handler behind HAProxy (so are cold envs and ACME
    challenges): while that process is away, HAProxy retries its socket and the request is answered by the next
    process, listening at the same path, instead of failing."""
    first = Backend("first")
    port = free_port()
    cache = tmp_path / "cache"
    password_hash = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
    guarded = pb.Middleware(basic_auth_username="ann", basic_auth_password_hash=password_hash)
    good = {"Authorization": "Basic " + base64.b64encode(b"ann:secret").decode()}
    async with serving(first), proxy_process(nats_url, port, cache, "before", tmp_path / "before.log") as before:
        await first_heartbeat(conn, "before")
        await routes.publish(
            http_route(HOST, "e1", [endpoint(first.addr)]),
            http_route(AUTH, "e2", [endpoint(first.addr)], middleware=guarded),
        )
        async with fresh() as client:
            await eventually(lambda: answers(client, port, HOST, "first"), 30, "the plain route served")
        await eventually(lambda: (cache / "routes.pb").exists(), 10, "the routes cached")
        plain, auth = Load(port).start(), Load(port, AUTH, good).start()
        try:
            await auth.answered(20, "basic-auth requests through the first proxy process")
            before.kill()
            assert await asyncio.wait_for(before.wait(), 10) == -signal.SIGKILL
            # Time passes with no proxy process: HAProxy alone answers the plain route meanwhile.
            await plain.answered(100, "plain requests answered while no proxy process runs")
            async with proxy_process(nats_url, port, cache, "after", tmp_path / "after.log"):
                await first_heartbeat(conn, "after")
                await auth.answered(20, "basic-auth requests through the next proxy process")
                await plain.stop()
                await auth.stop()
                assert plain.failures == []
                assert auth.failures == [], (
                    f"{len(auth.failures)} of {auth.ok + len(auth.failures)}: {auth.failures[:5]}"
                )
        finally:
            await plain.stop()
            await auth.stop()


IngressFactory = Callable[..., Awaitable[HAProxyIngress]]


@pytest.fixture
async def make_ingress(nats_url: str) -> AsyncIterator[IngressFactory]:
    started: list[HAProxyIngress] = []

    async def make(cache_dir: Path, **overrides: Any) -> HAProxyIngress:
        ingress = haproxy_ingress(settings(**overrides), nats_url=nats_url, cache_dir=cache_dir)
        await ingress.start()
        started.append(ingress)
        await asyncio.wait_for(ingress.proxy.wait_connected(), 10)
        return ingress

    yield make
    for ingress in started:
        await ingress.stop()


async def dead_pid() -> int:
    process = await asyncio.create_subprocess_exec("true")
    await process.wait()
    return process.pid


@pytest.mark.parametrize("stale", ["dead pid", "not haproxy", "another directory's haproxy"])
async def test_a_stale_pid_file_is_not_adopted_and_a_clean_stop_leaves_nothing(
    stale: str, make_ingress: IngressFactory, routes: Routes, tmp_path: Path
) -> None:
    backend = Backend("fresh")
    async with serving(backend), fresh() as client:
        other: HAProxyIngress | None = None
        if stale == "dead pid":
            pid = await dead_pid()
        elif stale == "not haproxy":
            pid = os.getpid()  # this test process: alive, and no HAProxy
        else:
            other = await make_ingress(tmp_path / "other")
            assert other.engine.pid is not None
            pid = other.engine.pid
        layout = layout_of(tmp_path / "cache")
        layout.directory.mkdir(parents=True)
        layout.pid_file.write_text(f"{pid}\n")
        ingress = await make_ingress(tmp_path / "cache")
        assert not ingress.engine.adopted
        assert ingress.engine.pid not in (None, pid)
        await eventually(lambda: layout.pid_file.read_text().strip() == str(ingress.engine.pid), 10, "its pid file")
        await routes.publish(http_route(HOST, "e1", [endpoint(backend.addr)]))
        port = int(ingress.layout.bind.rpartition(":")[2])
        await eventually(lambda: answers(client, port, HOST, "fresh"), 30, "the new HAProxy serves")
        if other is not None:  # untouched, still its own directory's
            await eventually(lambda: master_is(other.layout, pid), 10, "the other directory's master")
        await ingress.stop()
        await eventually(lambda: haproxy_pids(tmp_path / "cache") == [], 10, "no HAProxy left after a clean stop")
        assert not layout.pid_file.exists()


async def test_an_adopted_haproxy_that_exits_is_restarted(
    nats_url: str, conn: Connection, routes: Routes, make_ingress: IngressFactory, tmp_path: Path
) -> None:
    """Its exit is learnt from a pidfd (not our child), and a new HAProxy is started as for our own."""
    backend = Backend("again")
    port = free_port()
    cache = tmp_path / "cache"
    layout = layout_of(cache)
    async with serving(backend), fresh() as client:
        async with proxy_process(nats_url, port, cache, "crashed", tmp_path / "crashed.log") as crashed:
            await first_heartbeat(conn, "crashed")
            await routes.publish(http_route(HOST, "e1", [endpoint(backend.addr)]))
            await eventually(lambda: answers(client, port, HOST, "again"), 30, "the route served")
            await eventually(lambda: (cache / "routes.pb").exists(), 10, "the routes cached")
            crashed.kill()
            await crashed.wait()
        master = int(layout.pid_file.read_text())
        ingress = await make_ingress(cache, port=port)
        assert ingress.engine.adopted
        assert ingress.engine.pid == master
        await eventually(lambda: answers(client, port, HOST, "again"), 10, "the adopted HAProxy serves")
        os.kill(master, signal.SIGKILL)
        await eventually(lambda: ingress.engine.restarts == 1, 20, "the adopted HAProxy's exit seen, a new one started")
        assert not ingress.engine.adopted
        assert ingress.engine.pid not in (None, master)
        await eventually(lambda: answers(client, port, HOST, "again"), 30, "the new HAProxy serves")
        await ingress.stop()
    await eventually(lambda: haproxy_pids(tmp_path) == [], 10, "no HAProxy left after a clean stop")
