"""A rolling upgrade of a 3-server cluster under traffic: each server runs a NATS server, the all-in-one
control plane, an agent and a proxy of the previous release (tests/upgrade/previous.py), serving an app
with a replica per server. One server at a time is taken out of the load balancer's rotation, its
processes stopped (the agent's instances keep running), its NATS server restarted, and this release
started in their place (its control plane migrates the schema while the others still run the previous
release: the skew window); back in rotation once its proxy serves. Clients see no failed request.

``make test`` upgrades the first server only (the mixed cluster, the migration under traffic: ~1-2 min);
``make chaos`` upgrades all three, then deploys and rolls back with this release's CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from shared.embedded import EmbeddedNats
from shared.migrations.registry import SCHEMA
from shared.version import VERSION
from tests.chaos.cluster import NatsCluster
from tests.e2e.cluster import FAST_TIMERS, Load, kill_tree_under, version_of
from tests.e2e.upcmd import THIS, Release, listen_port
from tests.upgrade.previous import extract
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HOST = "roll.localhost"
ENV = "roll/web/prod"
TIMERS = {
    **FAST_TIMERS,
    # A node restarted by its operator is not a lost node: it comes back within the deadline.
    "ZATTERA_NODE_HEARTBEAT_DEADLINE": "60",
    "ZATTERA_LIVENESS_GRACE": "60",
    "ZATTERA_CONSOLE_PORT": "0",
}
TOML = f"""
project = "roll"
app = "web"

[run]
command = "python3 app.py"

[env.prod]
replicas = 3
resources = {{ cpu_millis = 10, memory_mb = 16 }}
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
domains = ["{HOST}"]
"""


@dataclass
class Server:
    """One machine of the cluster: its NATS server and Zattera's processes on it, of one release."""

    index: int
    nats: EmbeddedNats
    root: Path
    proxy_port: int
    release: Release = THIS
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argvs: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    @property
    def node(self) -> str:
        return f"s{self.index}"

    def start(self, urls: str, release: Release) -> None:
        self.release = release
        env = {**os.environ, **TIMERS, **release.env, "ZATTERA_DATA_DIR": str(self.root / "control")}
        python = [sys.executable, "-m"]
        agent = [
            *python,
            "services.agent",
            "--nats",
            urls,
            "--node-id",
            self.node,
            "--data-dir",
            str(self.root / "agent"),
            "--roles",
            "worker,control",
            *(["--builder"] if self.index == 0 else []),
        ]
        proxy = [
            *python,
            "services.proxy",
            "--nats",
            urls,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.proxy_port),
            "--node-id",
            self.node,
            "--proxy-id",
            self.node,
            "--cache-dir",
            str(self.root / "proxy"),
        ]
        self.env = env
        self.argvs = {"control-plane": [*python, "cli.control_plane", "--nats", urls], "agent": agent, "proxy": proxy}
        for name in self.argvs:
            self._launch(name)

    def _launch(self, name: str) -> None:
        with open(self.root / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                self.argvs[name],
                cwd=self.release.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def restart_exited(self) -> None:
        """What a service manager does (systemd's Restart=, zattera up): a process that exits is started
        again (a process exits on purpose when it cannot go on, e.g. an agent whose view could not open)."""
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.restarts += 1
                self._launch(name)

    def stop(self) -> None:
        """SIGTERM, as systemd stops a unit: an agent without --stop-on-exit leaves its instances running."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.argvs.clear()

    def logs(self) -> str:
        return "\n".join(
            f"==> {self.node} {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
            for p in sorted(self.root.glob("*.log"))
        )


@dataclass
class Balanced(Load):
    """:class:`Load` through a load balancer: requests go round-robin to the proxies in :attr:`rotation`."""

    rotation: list[int] = field(default_factory=list)
    _next: int = 0

    async def _one(self, session: aiohttp.ClientSession) -> None:
        self._next += 1
        self.port = self.rotation[self._next % len(self.rotation)]
        await super()._one(session)


async def answers(port: int, version: str = "") -> bool:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session,
            session.get(f"http://127.0.0.1:{port}/", headers={"Host": HOST}) as response,
        ):
            return response.status == 200 and (not version or version_of(await response.text()) == version)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


def cli(release: Release, urls: str, *args: str, timeout: float = 300.0) -> str:
    done = subprocess.run(
        [*release.argv, *args],
        cwd=release.cwd,
        env={**os.environ, **TIMERS, **release.env, "ZATTERA_NATS_URL": urls},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"zattera {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def app_source(dest: Path, version: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    app = (Path(__file__).resolve().parents[2] / "examples" / "hello" / "app.py").read_text()
    (dest / "app.py").write_text(app.replace('os.environ.get("HELLO_VERSION", "v1")', f'"{version}"'))
    (dest / "zattera.toml").write_text(TOML)
    return dest


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_tree_under(tmp_path, also_matching=str(tmp_path))


async def supervise(servers: list[Server], stopping: set[str]) -> None:
    """Restart what exits on the servers, but those in ``stopping`` (the test is stopping them)."""
    while True:
        for server in servers:
            if server.node not in stopping:
                server.restart_exited()
        await asyncio.sleep(0.5)


async def rolling_upgrade(work: Path, upgraded: int) -> None:
    previous = extract(work / "previous")
    nats = NatsCluster(work / "nats").start()
    servers = [Server(i, nats.servers[i], work / f"s{i}", listen_port()) for i in range(3)]
    for server in servers:
        server.root.mkdir(parents=True)
    urls = nats.urls
    stopping: set[str] = set()
    supervisor: asyncio.Task[None] | None = None
    load = Balanced(port=servers[0].proxy_port, host=HOST, rate=20.0, rotation=[s.proxy_port for s in servers])
    try:
        cli(previous, urls, "cluster", "init", "--replicas", "3")
        for server in servers:
            server.start(urls, previous)
        supervisor = asyncio.create_task(supervise(servers, stopping))
        source = app_source(work / "app", "v1")
        cli(previous, urls, "apps", "apply", str(source / "zattera.toml"))
        cli(previous, urls, "deploy", str(source), "--env", ENV)
        for server in servers:
            await eventually(lambda s=server: answers(s.proxy_port, "v1"), 120, f"{server.node}'s proxy serves")

        load.start()
        for server in servers[:upgraded]:
            load.rotation.remove(server.proxy_port)  # the load balancer drains it first
            print(f"{time.time():.3f} {server.node} ({server.proxy_port}) out of rotation: {load.rotation}")
            await asyncio.sleep(1.0)  # the requests it had in flight finish (none may fail meanwhile)
            # Blocking steps run in threads: the load's event loop must not stall (a stall reads as failures).
            stopping.add(server.node)
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.nats.stop)
            await asyncio.to_thread(server.nats.start)
            await asyncio.to_thread(server.start, urls, THIS)
            stopping.discard(server.node)
            await eventually(lambda s=server: answers(s.proxy_port, "v1"), 180, f"{server.node} serves again")
            load.rotation.append(server.proxy_port)
            print(f"{time.time():.3f} {server.node} back in rotation: {load.rotation}")

        async def migrated() -> bool:
            """The upgraded control plane runs the migrations once it has started (after its proxy serves)."""
            status = json.loads(await asyncio.to_thread(cli, THIS, urls, "cluster", "status", "--json"))
            return bool((status["config"]["schema"], status["config"]["version"]) == (SCHEMA, VERSION))

        await eventually(migrated, 120, f"the cluster at schema {SCHEMA} (Zattera {VERSION})")

        expected = {s.node: VERSION if s.index < upgraded else "0.1.0" for s in servers}

        async def reported() -> bool:
            listed = json.loads(await asyncio.to_thread(cli, THIS, urls, "nodes", "list", "--json"))
            return {n["meta"]["id"]: n["binary_version"] for n in listed} == expected

        await eventually(reported, 60, f"nodes report {expected}")
        if upgraded == len(servers):
            source = app_source(work / "app", "v2")
            await asyncio.to_thread(cli, THIS, urls, "deploy", str(source), "--env", ENV)
            await eventually(lambda: load.versions["v2"] > 20, 120, "v2 serves")
            await asyncio.to_thread(cli, THIS, urls, "rollback", "--env", ENV)
            await eventually(lambda: answers(servers[0].proxy_port, "v1"), 120, "v1 serves again")
        await asyncio.sleep(2.0)
        await load.stop()
        print(load.summary(), {s.node: s.restarts for s in servers})
        assert load.failures == [], load.summary()
        assert load.ok > 100, load.summary()
    except BaseException:
        await load.stop()
        print(load.summary(), {s.node: s.restarts for s in servers})
        for server in servers:
            print(server.logs())
        raise
    finally:
        if supervisor is not None:
            supervisor.cancel()
        for server in servers:
            server.stop()
        nats.stop()


async def test_upgrading_one_server_of_three_keeps_serving_with_the_previous_release_beside_it(work: Path) -> None:
    await rolling_upgrade(work, upgraded=1)


@pytest.mark.chaos
async def test_a_rolling_upgrade_of_three_servers_keeps_serving_then_deploys_and_rolls_back(work: Path) -> None:
    await rolling_upgrade(work, upgraded=3)
