"""The spy (``tests/apps/spy``) under the docker runtime: a real agent, real NATS, the session's private Docker
daemon (``tests/dockerd.py``). The spy's container runs on the Python base image the agent makes from the
node's interpreter, beside a victim container of another environment and a host process that both hold a
secret in their environment. It must get none of it, nor the agent's files, nor either Docker socket, nor
NATS. It runs as its environment's user, so the agent's network fence resets its connections to the
agent's own NATS server, open as it is, and to the secured one this test starts (SECURITY.md).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import os
import secrets
import sys
import tarfile
from pathlib import Path
from urllib.parse import quote

import aiodocker
import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.docker_containers import BRIDGE_NETWORK
from services.agent.pythonbase import PYTHON_LABEL
from services.agent.settings import AgentSettings
from shared.connection import Connection
from shared.embedded import EmbeddedNats
from shared.registry import PlatformImage, push_image
from shared.security.setup import prepare
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, release
from tests.agent.test_docker_runtime import output_of
from tests.agent.test_runtime import seed, state_of
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(300)

SPY = Path(__file__).resolve().parents[1] / "apps" / "spy" / "spy.py"
NODE_PYTHON = os.path.realpath(sys.executable)


def spy_image(settings: str) -> PlatformImage:
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for name, data in (("app/spy.py", SPY.read_bytes()), ("app/spy.env", settings.encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    config = {
        "config": {"Cmd": ["python3", "/app/spy.py"], "WorkingDir": "/app", "Labels": {PYTHON_LABEL: NODE_PYTHON}}
    }
    return PlatformImage("linux/amd64", json.dumps(config).encode(), [gzip.compress(layer.getvalue())])


def report_of(tmp_path: Path, assignment_id: str) -> dict[str, object]:
    for line in output_of(tmp_path, "d1", assignment_id).splitlines():
        if line.startswith("SPY-REPORT "):
            return dict(json.loads(line.removeprefix("SPY-REPORT ")))
    return {}


async def test_a_spy_container_gets_nothing_of_the_agent_other_apps_the_host_or_docker(
    start_agent: StartAgent,
    docker_host: str,
    conn: Connection,
    view: StateView,
    writer: Writer,
    tmp_path: Path,
    nats_url: str,
) -> None:
    setup = prepare(tmp_path / "secured" / "security")
    secured = EmbeddedNats(data_dir=tmp_path / "secured" / "nats", extra_config=setup.server_config()).start()
    data_dir = tmp_path / "agent-d1"
    secret = f"secret-{secrets.token_hex(8)}"
    host = await asyncio.create_subprocess_exec("sleep", "120", env={"HOST_TOKEN": secret})
    try:
        running = await start_agent("d1", runtime="docker", docker_host=docker_host)
        assert running.agent.node is not None and running.agent.node.isolation == "container"
        (data_dir / "node.creds").write_text("NODE-CREDENTIAL")
        victim = release("exec:" + quote("exec sleep 120", safe=""), env_id="VICTIM", healthcheck=False)
        victim.service.vars["VICTIM_TOKEN"] = secret
        victim_a = assignment("d1", victim)
        await seed(writer, victim, victim_a)
        await eventually(lambda: state_of(view, "d1", victim_a.meta.id) == pb.INSTANCE_STATE_HEALTHY, what="victim")

        socket = docker_host.removeprefix("unix://")
        settings = (
            f"SPY_PATHS={data_dir}:{data_dir / 'node.creds'}:{tmp_path}\n"
            f"SPY_NATS={nats_url.removeprefix('nats://')},{secured.url.removeprefix('nats://')}\n"
            f"SPY_SOCKETS={socket},/var/run/docker.sock\n"
        )
        await push_image(conn, repo="spies/spy", tag="v1", images=[spy_image(settings)])
        spy = release("spies/spy:v1", env_id="SPY", healthcheck=False)
        spy_a = assignment("d1", spy)
        await seed(writer, spy, spy_a)
        await eventually(lambda: bool(report_of(tmp_path, spy_a.meta.id)), what="the spy's report", timeout=180)
    finally:
        host.kill()
        await host.wait()
        secured.stop()

    report = report_of(tmp_path, spy_a.meta.id)
    text = json.dumps(report)
    assert secret not in text and "NODE-CREDENTIAL" not in text and "NKEY SEED" not in text
    files = report["files"]
    assert isinstance(files, dict)
    assert files["read"] == {} and files["listed"] == {}, files  # nothing of the host's filesystem exists inside
    proc = report["proc"]
    assert isinstance(proc, dict) and len(proc["pids"]) <= 4, proc["pids"]  # tini, the spy (its own namespace)
    docker = report["docker"]
    assert isinstance(docker, dict)
    assert all(answer.startswith("unreachable: [Errno 2]") for answer in docker.values()), docker
    nats = report["nats"]
    assert isinstance(nats, dict)
    # The agent's NATS server answers anybody (open), but the fence resets the spy's connection to it; the
    # secured one listens in the agent's process tree (this test's), so it is fenced as well.
    for url in (nats_url, secured.url):
        assert nats[url.removeprefix("nats://")].startswith("unreachable: [Errno 111]"), nats
    identity = report["identity"]
    assert isinstance(identity, dict)
    assert identity["uid"] >= AgentSettings(node_id="x").sandbox_uid_base, identity  # its environment's user
    assert identity["status"]["CapEff"] == "0000000000000000"
    assert identity["status"]["NoNewPrivs"] == "1"


async def test_a_bridged_spy_cannot_connect_to_the_agents_listeners_on_the_nodes_address(
    start_agent: StartAgent, docker_host: str, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    """On the bridge network a container has its own network namespace: its packets reach the node from the
    bridge (INPUT), not through OUTPUT, so the fence watches the bridge's interface too. A listener of the
    agent's process tree on every address is reset at the bridge's gateway; an allowed port is not."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"INFO {}\r\n")
        await writer.drain()
        writer.close()

    fenced = await asyncio.start_server(greet, "0.0.0.0", 0)
    allowed = await asyncio.start_server(greet, "0.0.0.0", 0)
    ports = [server.sockets[0].getsockname()[1] for server in (fenced, allowed)]
    try:
        await start_agent(
            "d1", runtime="docker", docker_host=docker_host, docker_network="bridge", sandbox_fence_allow=[ports[1]]
        )
        docker = aiodocker.Docker(url=docker_host)
        try:
            network = await (await docker.networks.get(BRIDGE_NETWORK)).show()
        finally:
            await docker.close()
        gateway = network["IPAM"]["Config"][0]["Gateway"]
        targets = [f"{gateway}:{port}" for port in ports]
        await push_image(conn, repo="spies/spy", tag="v1", images=[spy_image(f"SPY_NATS={','.join(targets)}\n")])
        spy = release("spies/spy:v1", env_id="SPY", healthcheck=False)
        spy_a = assignment("d1", spy)
        await seed(writer, spy, spy_a)
        await eventually(lambda: bool(report_of(tmp_path, spy_a.meta.id)), what="the spy's report", timeout=180)
    finally:
        for server in (fenced, allowed):
            server.close()
    nats = report_of(tmp_path, spy_a.meta.id)["nats"]
    assert isinstance(nats, dict)
    assert nats[targets[0]].startswith("unreachable: [Errno 111]"), nats  # reset by the fence
    assert "[Errno 111]" not in nats[targets[1]] and "No route" not in nats[targets[1]], nats  # reached
