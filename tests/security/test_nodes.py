"""The real node processes on a secured cluster: an agent that joins with a token, runs what it is assigned
and restarts from its stored credential; a proxy that follows route snapshots with a proxy credential."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import aiohttp
import psutil
import pytest
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from services.agent.credentials import CREDS_FILE, creds_name
from services.agent.registration import host_os_arch
from shared import keys as K
from shared.connection import Connection
from shared.embedded import free_port
from shared.ids import new_id
from shared.registry import PlatformImage, push_image
from shared.routewire import content_digest, encode_messages
from shared.security.authority import RoleIssuer
from shared.security.join import JoinService
from shared.security.join_client import join, request_join_token
from shared.security.permissions import Role
from shared.subjects import LIVE_PREFIX, LIVE_STREAM, ROUTES_GET_SUBJECT, STATE_PREFIX, STATE_STREAM
from shared.tasks import cancel_and_wait
from tests.proxy.harness import Backend, Routes, endpoint, http_route, serving
from tests.security.conftest import ManualClock, SecureCluster
from tests.waiting import eventually

PROJECT_ROOT = Path(__file__).resolve().parents[2]
NODE = "joined-node"
FAST_AGENT = {
    "ZATTERA_AGENT_HEARTBEAT_INTERVAL": "0.5",
    "ZATTERA_AGENT_RECONCILE_TICK": "1",
    "ZATTERA_AGENT_REPORT_RETRY": "0.1",
    "ZATTERA_AGENT_DEFAULT_STOP_GRACE": "2",
    "ZATTERA_AGENT_STARTUP_PROBE_INTERVAL": "0.05",
}


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A node process's environment: no credential inherited, short timers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_")}
    return {**env, "ZATTERA_DATA_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", **FAST_AGENT, **extra}


class NodeProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *argv], cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for process in started:
        process.stop()
    for proc in psutil.process_iter(["cwd"]):  # safety net: no instance outlives the test
        with contextlib.suppress(psutil.Error):
            if (proc.info["cwd"] or "").startswith(str(tmp_path)) and "ZATTERA_ASSIGNMENT_ID" in proc.environ():
                proc.kill()


async def put(conn: Connection, msg: pb.Node | pb.Release | pb.Assignment | pb.Volume, key: str = "") -> None:
    """A control-plane write (the services hold the control credential)."""
    await conn.js.publish(STATE_PREFIX + (key or K.key_of(msg)), K.encode(msg), stream=STATE_STREAM)


async def observed(conn: Connection, node_id: str, assignment_id: str) -> pb.AssignmentObserved | None:
    try:
        msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.observed(node_id, assignment_id), direct=True)
    except NotFoundError:
        return None
    return pb.AssignmentObserved.FromString(msg.data) if msg.data else None


async def wait_state(conn: Connection, assignment_id: str, state: int, agent: NodeProcess) -> pb.AssignmentObserved:
    seen: list[pb.AssignmentObserved | None] = [None]

    async def reached() -> bool:
        assert agent.proc.poll() is None, f"the agent exited:\n{agent.output()}"
        seen[0] = await observed(conn, NODE, assignment_id)
        return seen[0] is not None and seen[0].state == state

    try:
        await eventually(reached, 20, f"{assignment_id} {pb.InstanceState.Name(state)}")  # type: ignore[arg-type]
    except AssertionError:
        raise AssertionError(f"last report {seen[0]}; agent log:\n{agent.output()}") from None
    assert seen[0] is not None
    return seen[0]


def release(image_ref: str, **service: object) -> pb.Release:
    r = pb.Release(environment_id="E1", project_id="P1", app_id="A1", version=1, image_ref=image_ref)
    r.meta.id = new_id()
    r.config_hash = "cfg-1"
    r.service.MergeFrom(pb.ServiceSpec(**service))  # type: ignore[arg-type]
    return r


def assignment(node_id: str, rel: pb.Release) -> pb.Assignment:
    a = pb.Assignment(
        node_id=node_id,
        project_id=rel.project_id,
        app_id=rel.app_id,
        environment_id=rel.environment_id,
        release_id=rel.meta.id,
        config_hash=rel.config_hash,
        desired=pb.ASSIGNMENT_DESIRED_RUN,
    )
    a.meta.id = new_id()
    return a


def leased_volume(name: str, a: pb.Assignment) -> pb.Volume:
    v = pb.Volume(project_id=a.project_id, environment_id=a.environment_id, name=name, node_id=a.node_id)
    v.meta.id = new_id()
    v.lease.node_id = a.node_id
    v.lease.assignment_id = a.meta.id
    v.lease.expires_at.FromSeconds(int(time.time()) + 600)
    return v


async def test_an_agent_joins_runs_its_assignments_and_restarts_from_its_stored_credential(
    secure: SecureCluster, control: Connection, join_service: JoinService, tmp_path: Path, processes: list[NodeProcess]
) -> None:
    token = await request_join_token(control, ttl=600, node_id=NODE)
    data_dir = tmp_path / "agent"
    argv = ["-m", "services.agent", "--nats", secure.url, "--node-id", NODE, "--data-dir", str(data_dir)]
    argv += ["--stop-on-exit", "--log-level", "DEBUG"]
    env = child_env(tmp_path, ZATTERA_AGENT_JOIN_TOKEN=token)
    agent = NodeProcess(argv, env, tmp_path / "agent-1.log")
    processes.append(agent)

    async def registered() -> bool:
        assert agent.proc.poll() is None, f"the agent exited:\n{agent.output()}"
        with contextlib.suppress(NotFoundError):
            msg = await control.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.node(NODE), direct=True)
            return pb.Node.FromString(msg.data).status == pb.NODE_STATUS_ALIVE
        return False

    await eventually(registered, 20, "the joined agent registered its node")
    creds = data_dir / CREDS_FILE
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert creds_name(creds) == NODE

    # The control plane assigns it a stateless instance and a stateful one under a volume lease; and
    # another node's assignment, which this agent can neither read nor run.
    # The stateless one runs a registry image by tag: tag lookup and image store reads on its credential.
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w:gz") as tar:
        info = tarfile.TarInfo("app/run.sh")
        script = b"exec sleep 60\n"
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script))
    config = {"config": {"Cmd": ["/bin/sh", "run.sh"], "WorkingDir": "/app"}}
    image = PlatformImage(host_os_arch(), json.dumps(config).encode(), [layer.getvalue()])
    await push_image(control, repo="p1/a1", tag="v1", images=[image])
    stateless = release("p1/a1:v1")
    stateful = release(f"exec:{quote('sleep 60', safe='')}", stateful=True)
    stateful.service.volumes.add(volume_name="data", mount_path="/data")
    plain, pinned, foreign = assignment(NODE, stateless), assignment(NODE, stateful), assignment("other", stateless)
    for msg in (stateless, stateful, leased_volume("data", pinned), plain, pinned, foreign):
        await put(control, msg)

    first = await wait_state(control, plain.meta.id, pb.INSTANCE_STATE_HEALTHY, agent)
    await wait_state(control, pinned.meta.id, pb.INSTANCE_STATE_HEALTHY, agent)
    assert await observed(control, "other", foreign.meta.id) is None
    live = await control.js.get_last_msg(LIVE_STREAM, f"{LIVE_PREFIX}node.{NODE}", direct=True)
    assert live.data

    # In a thread: the relay of its last reports runs on this event loop (the join service fixture).
    assert await asyncio.to_thread(agent.stop) == 0
    stopped = await observed(control, NODE, plain.meta.id)
    assert stopped is not None and stopped.state == pb.INSTANCE_STATE_STOPPED

    # The token is used now; starting again with it just uses the stored credential.
    again = NodeProcess(argv, env, tmp_path / "agent-2.log")
    processes.append(again)
    second = await wait_state(control, plain.meta.id, pb.INSTANCE_STATE_HEALTHY, again)
    assert second.container_id != first.container_id
    assert "already joined" in again.output()
    assert await asyncio.to_thread(again.stop) == 0
    assert "permissions violation" not in agent.output() + again.output()


async def test_a_used_join_token_without_a_stored_credential_stops_the_agent(
    secure: SecureCluster, control: Connection, join_service: JoinService, tmp_path: Path, processes: list[NodeProcess]
) -> None:
    token = await request_join_token(control, ttl=600)
    await join(secure.url, token, "late")  # another node used it
    argv = ["-m", "services.agent", "--nats", secure.url, "--node-id", "late2", "--data-dir", str(tmp_path / "b")]
    agent = NodeProcess([*argv, "--join-token", token], child_env(tmp_path), tmp_path / "agent.log")
    processes.append(agent)
    assert await asyncio.to_thread(agent.proc.wait, 20) == 2
    assert "join token already used (node late joined with it" in agent.output()
    assert not (tmp_path / "b" / CREDS_FILE).exists()


async def test_a_proxy_with_its_own_credential_routes_from_snapshots(
    secure: SecureCluster, control: Connection, tmp_path: Path, processes: list[NodeProcess]
) -> None:
    backend, other = Backend("first"), Backend("second")
    routes = Routes(control)
    current = [routes.snapshot()]

    async def answer_get(msg: object) -> None:  # the routes service's answer to zattera.routes.get
        snap = current[0]
        data = snap.SerializeToString(deterministic=True)
        for message in encode_messages(
            data, version=snap.version, digest=content_digest(data), max_message_bytes=1 << 20
        ):
            await control.nc.publish(msg.reply, message.body, headers=message.headers)  # type: ignore[attr-defined]

    responder = await control.nc.subscribe(ROUTES_GET_SUBJECT, cb=answer_get)
    port = free_port()
    async with serving(backend, other), aiohttp.ClientSession() as http:
        current[0] = routes.snapshot(http_route("app.secure.test", endpoints=[endpoint(backend.addr)]))
        argv = ["-m", "services.proxy", "--nats", secure.url, "--port", str(port), "--host", "127.0.0.1"]
        argv += ["--proxy-id", "edge-1", "--node-id", NODE, "--cache-dir", str(tmp_path / "proxy")]
        argv += ["--log-level", "DEBUG"]
        env = child_env(tmp_path, ZATTERA_NATS_CREDS=secure.creds(Role.PROXY, "edge-1"))
        proxy = NodeProcess(argv, env, tmp_path / "proxy.log")
        processes.append(proxy)

        async def answers(body: str) -> bool:
            assert proxy.proc.poll() is None, f"the proxy exited:\n{proxy.output()}"
            with contextlib.suppress(aiohttp.ClientError):
                url = f"http://127.0.0.1:{port}/"
                async with http.get(url, headers={"Host": "app.secure.test"}) as response:
                    return response.status == 200 and await response.text() == body
            return False

        await eventually(lambda: answers("first"), 20, "the proxy routes from the snapshot it asked for")
        # A pushed snapshot (zattera.routes.snapshot) replaces it.
        await routes.publish(http_route("app.secure.test", endpoints=[endpoint(other.addr)]))
        await eventually(lambda: answers("second"), 10, "the proxy follows a published snapshot")

        async def heartbeat() -> bool:
            with contextlib.suppress(NotFoundError):
                return bool(await control.js.get_last_msg(LIVE_STREAM, f"{LIVE_PREFIX}proxy.edge-1", direct=True))
            return False

        await eventually(heartbeat, 10, "the proxy's heartbeat under its own live key")
        assert proxy.stop() == 0
    await responder.unsubscribe()
    assert "permissions violation" not in proxy.output()


async def test_an_agent_started_before_the_control_plane_waits_for_its_view_instead_of_exiting(
    secure: SecureCluster, control: Connection, tmp_path: Path, processes: list[NodeProcess], clock: ManualClock
) -> None:
    """``zattera up --secure`` starts the control plane and the local node together: the agent may ask for its
    view before the join service serves ``zattera.view.open``. It waits; it used to exit (1) and be restarted."""
    argv = ["-m", "services.agent", "--nats", secure.url, "--node-id", "early", "--data-dir", str(tmp_path / "a")]
    env = child_env(tmp_path, ZATTERA_NATS_CREDS=secure.creds(Role.BUILDER, "early"))
    agent = NodeProcess([*argv, "--stop-on-exit"], env, tmp_path / "early.log")
    processes.append(agent)
    await eventually(lambda: "waiting for the control plane to open its view" in agent.output(), 20, "a wait")
    assert agent.proc.poll() is None, agent.output()
    issuers = {role: RoleIssuer.load(secure.setup.directory, role) for role in (Role.AGENT, Role.BUILDER)}
    service = JoinService(control, issuers, secure.setup.sentinel_jwt(), now=clock)
    task = asyncio.create_task(service.run())
    try:

        async def registered() -> bool:
            assert agent.proc.poll() is None, f"the agent exited:\n{agent.output()}"
            with contextlib.suppress(NotFoundError):
                msg = await control.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.node("early"), direct=True)
                return pb.Node.FromString(msg.data).status == pb.NODE_STATUS_ALIVE
            return False

        await eventually(registered, 30, "the agent registered once the view service answered")
        assert "task failed" not in agent.output()
        assert await asyncio.to_thread(agent.stop) == 0
    finally:
        await cancel_and_wait(task)
