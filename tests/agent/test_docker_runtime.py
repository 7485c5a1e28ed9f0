"""The docker runtime end to end: real NATS, a real agent, a real (private) Docker daemon.

The apps are busybox shell commands on the session's base image (``tests/dockerd.py``): ``httpd`` serves,
``/proc`` tells what an instance sees. Each test is a few container starts (vfs storage: ~0.5 s each).
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from urllib.parse import quote

import aiodocker
import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.docker_containers import ContainerHandle, container_config
from services.agent.docker_images import ContainerImage
from services.agent.docker_runtime import DockerLauncher
from services.agent.launchers import LaunchPlan
from services.agent.runtime_choice import DockerUnavailable, choose_launcher
from services.agent.settings import AgentSettings
from shared import keys as K
from shared.connection import Connection
from shared.ids import new_id
from shared.live import node_key
from shared.registry import PlatformImage, push_image
from shared.runtime_note import read_runtime_note
from shared.state.feed import StateView
from shared.subjects import LIVE_PREFIX, LIVE_STREAM
from shared.txn import Writer
from tests.agent.conftest import RunningAgent, StartAgent, assignment, release
from tests.agent.test_runtime import http_get, seed, set_desired, state_of
from tests.waiting import eventually

HEALTHY = pb.INSTANCE_STATE_HEALTHY
STOPPED = pb.INSTANCE_STATE_STOPPED

SERVE = (
    "mkdir -p /tmp/www && echo hello from $ZATTERA_ASSIGNMENT_ID > /tmp/www/index.html && "
    "echo ok > /tmp/www/health && exec httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h /tmp/www"
)


def exec_ref(command: str) -> str:
    return "exec:" + quote(command, safe="")


def docker_release(command: str, *, healthcheck: bool = True, **resources: int) -> pb.Release:
    rel = release(exec_ref(command), healthcheck=healthcheck)
    for name, value in resources.items():
        setattr(rel.service.resources, name, value)
    return rel


def output_of(tmp_path: Path, node_id: str, assignment_id: str, stream: str = "stdout") -> str:
    path = tmp_path / f"agent-{node_id}" / "instances" / assignment_id / f"{stream}.log"
    return path.read_text() if path.exists() else ""


async def start_docker_agent(
    start_agent: StartAgent, docker_host: str, node_id: str = "d1", **overrides: object
) -> RunningAgent:
    return await start_agent(node_id, runtime="docker", docker_host=docker_host, **overrides)


async def test_registry_image_runs_as_an_isolated_container(
    start_agent: StartAgent,
    docker_host: str,
    conn: Connection,
    view: StateView,
    writer: Writer,
    tmp_path: Path,
) -> None:
    """A registry image (one layer: the app directory) runs FROM the base image as its environment's user,
    without capabilities, in its own pid namespace, seeing neither the agent's data dir nor other instances."""
    running = await start_docker_agent(start_agent, docker_host)
    assert running.agent.node is not None and running.agent.node.runtime == "docker"
    secret = tmp_path / "agent-d1" / "node.creds"
    secret.write_text("SECRET")
    probe = (
        f"echo uid=$(id -u); echo procs=$(ls /proc | grep -c '^[0-9]'); "
        f"cat {secret} || echo creds-unreadable; ls {tmp_path} || echo data-dir-invisible; "
        f"grep CapEff /proc/self/status; exec sh /app/serve.sh"
    )
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        script = SERVE.encode()
        info = tarfile.TarInfo("app/serve.sh")
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))
    config = json.dumps({"config": {"Cmd": ["sh", "-c", probe], "WorkingDir": "/app"}}).encode()
    image = PlatformImage("linux/amd64", config, [gzip.compress(layer.getvalue())])
    await push_image(conn, repo="p1/a1", tag="v1", images=[image])
    rel = release("p1/a1:v1")
    a, other = assignment("d1", rel), assignment("d1", rel)
    await seed(writer, rel, a, other)

    await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="HEALTHY", timeout=30)
    observed = view.observed("d1", a.meta.id)
    assert observed is not None
    assert f"hello from {a.meta.id}" in await http_get(observed.mesh_port_bindings["http"])
    await eventually(lambda: "CapEff" in output_of(tmp_path, "d1", a.meta.id), what="the probe's output shipped")
    out = output_of(tmp_path, "d1", a.meta.id)
    uid = int(out.split("uid=")[1].split()[0])
    assert uid >= AgentSettings(node_id="x").sandbox_uid_base, out  # its environment's own user
    assert int(out.split("procs=")[1].split()[0]) <= 5, out  # its own pid namespace: init, itself and the probe
    assert "creds-unreadable" in out and "data-dir-invisible" in out and "SECRET" not in out
    assert "CapEff:\t0000000000000000" in out
    await eventually(lambda: state_of(view, "d1", other.meta.id) == HEALTHY, what="the other HEALTHY")
    assert other.meta.id not in out

    await set_desired(writer, view, a, pb.ASSIGNMENT_DESIRED_STOP)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == STOPPED, what="STOPPED")
    docker = aiodocker.Docker(url=docker_host)
    try:
        ids = {c.id for c in await docker.containers.list(all=True)}
    finally:
        await docker.close()
    assert observed.container_id not in ids, "a stopped instance's container is removed"


async def test_memory_hog_is_oom_killed_and_reported_so(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer
) -> None:
    await start_docker_agent(start_agent, docker_host, max_start_attempts=1)
    hog = "x=$(head -c 200000000 /dev/zero | tr '\\0' x); echo survived"
    rel = docker_release(hog, healthcheck=False, memory_mb=32)
    a = assignment("d1", rel)
    await seed(writer, rel, a)

    await eventually(
        lambda: state_of(view, "d1", a.meta.id) == pb.INSTANCE_STATE_FAILED, what="FAILED after its OOM", timeout=30
    )
    observed = view.observed("d1", a.meta.id)
    assert observed is not None
    assert observed.last_exit.oom_killed and observed.last_exit.signal == 9
    assert "out of memory" in observed.message


async def test_fork_bomb_stops_at_the_pids_limit(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await start_docker_agent(start_agent, docker_host, pids_limit=16)
    bomb = (
        "(i=0; while [ $i -lt 64 ]; do sleep 300 & i=$((i+1)); done) 2>&1; "
        "n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo procs=$n; exec sleep 300"
    )
    rel = docker_release(bomb, healthcheck=False)
    a = assignment("d1", rel)
    await seed(writer, rel, a)

    await eventually(lambda: "procs=" in output_of(tmp_path, "d1", a.meta.id), what="the bomb's count", timeout=30)
    out = output_of(tmp_path, "d1", a.meta.id)
    assert int(out.split("procs=")[1].split()[0]) <= 16
    assert "can't fork" in out


async def test_cpu_spinner_is_held_to_its_quota(
    start_agent: StartAgent, docker_host: str, conn: Connection, view: StateView, writer: Writer
) -> None:
    running = await start_docker_agent(start_agent, docker_host)
    rel = docker_release("while :; do :; done", healthcheck=False, cpu_millis=200)
    a = assignment("d1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="spinning", timeout=30)
    runtime = running.agent.runtime
    assert runtime is not None
    handle = runtime.running()[a.meta.id]
    assert isinstance(handle, ContainerHandle)
    cpu, memory = await handle.stats()
    assert 0 < cpu <= 30, f"{cpu:.1f}% of a core for a 200 millicore quota"
    assert memory > 0

    async def heartbeat_has_daemon_figures() -> bool:
        msg = await conn.js.get_last_msg(LIVE_STREAM, LIVE_PREFIX + node_key("d1"))
        sample = cpb.Heartbeat.FromString(msg.data or b"").instances[a.meta.id]
        return 0 < sample.cpu_percent <= 30 and sample.memory_bytes > 0

    await eventually(heartbeat_has_daemon_figures, what="a heartbeat with the daemon's figures")


async def test_volume_written_by_one_release_is_there_in_the_next(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await start_docker_agent(start_agent, docker_host)
    first = docker_release("echo kept > /data/note; " + SERVE)
    first.service.stateful = True
    first.service.volumes.add(volume_name="data", mount_path="/data")
    a = assignment("d1", first)
    volume = pb.Volume(project_id="P1", environment_id="E1", name="data", node_id="d1")
    volume.meta.id = "V1"
    volume.status = pb.VOLUME_STATUS_ACTIVE
    volume.lease.node_id, volume.lease.assignment_id = "d1", a.meta.id
    volume.lease.expires_at.GetCurrentTime()
    volume.lease.expires_at.seconds += 120
    await seed(writer, first, a, volume)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="first release HEALTHY", timeout=30)

    second = docker_release("echo found=$(cat $ZATTERA_VOLUME_DATA/note); " + SERVE)
    second.service.stateful = True
    second.service.volumes.add(volume_name="data", mount_path="/data")
    second.config_hash = "cfg-2"
    moved = pb.Assignment()
    moved.CopyFrom(view.assignment(a.meta.id))  # type: ignore[arg-type]
    moved.release_id, moved.config_hash = second.meta.id, "cfg-2"
    await seed(writer, second, moved)
    await eventually(lambda: "found=kept" in output_of(tmp_path, "d1", a.meta.id), what="the next release reads it")
    # Written by the container as its environment's user: the uid the table gave E1, as the sandbox would.
    uid = json.loads((tmp_path / "agent-d1" / "sandbox" / "uids.json").read_text())["env:E1"]
    assert (tmp_path / "agent-d1" / "volumes" / "V1" / "note").stat().st_uid == uid


async def test_restarted_agent_adopts_its_container_and_removes_the_rest(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    """No restart of the adopted one; its output copied on from where the first agent stopped, once."""
    first = await start_docker_agent(start_agent, docker_host, stop_on_exit=False)
    counter = "(i=0; while :; do echo line $i; i=$((i+1)); sleep 0.02; done) & "
    rel = docker_release(counter + SERVE)
    kept, dropped = assignment("d1", rel), assignment("d1", rel)
    await seed(writer, rel, kept, dropped)
    await eventually(
        lambda: state_of(view, "d1", kept.meta.id) == HEALTHY and state_of(view, "d1", dropped.meta.id) == HEALTHY,
        what="both HEALTHY",
        timeout=30,
    )
    container_id = view.observed("d1", kept.meta.id).container_id  # type: ignore[union-attr]
    dropped_id = view.observed("d1", dropped.meta.id).container_id  # type: ignore[union-attr]
    await eventually(lambda: "line 20" in output_of(tmp_path, "d1", kept.meta.id), what="output copied")
    await first.stop()
    await writer.commit(writer.txn().delete(K.assignment("d1", dropped.meta.id)))

    second = await start_docker_agent(start_agent, docker_host)
    runtime = second.agent.runtime
    assert runtime is not None
    await eventually(lambda: kept.meta.id in runtime.running(), what="kept one adopted")
    assert runtime.running()[kept.meta.id].container_id == container_id
    observed = view.observed("d1", kept.meta.id)
    assert observed is not None and observed.restarts == 0 and observed.state == HEALTHY
    await eventually(lambda: view.observed("d1", dropped.meta.id) is None, what="dropped one's report deleted")
    docker = aiodocker.Docker(url=docker_host)
    try:
        ids = {c.id for c in await docker.containers.list(all=True)}
    finally:
        await docker.close()
    assert container_id in ids and dropped_id not in ids

    def copied() -> list[int]:
        return [int(line.split()[1]) for line in output_of(tmp_path, "d1", kept.meta.id).splitlines()]

    before = len(copied())
    await eventually(lambda: len(copied()) > before + 20, what="output copied after the adoption")
    numbers = copied()
    assert numbers == list(range(len(numbers))), "every line once, in order, across the restart"


async def test_a_daemon_image_runs_read_only_with_an_exec_health_check_inside_the_container(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer
) -> None:
    """``docker://`` names an image of the daemon; the exec check sees the container's files, not the host's,
    on its read-only root filesystem."""
    await start_docker_agent(start_agent, docker_host)
    rel = release("docker://zattera/base:latest", healthcheck=False)
    rel.service.command = SERVE
    check = rel.service.healthcheck
    check.type = pb.HEALTH_CHECK_TYPE_EXEC
    check.command = "test -f /tmp/www/health && test ! -d /work && ! (echo x > /etc/probe) 2>/dev/null"
    rel.service.read_only_root = True  # /tmp stays writable (a tmpfs); /etc does not
    check.interval.FromMilliseconds(200)
    check.timeout.FromMilliseconds(2000)
    check.grace_period.FromSeconds(10)
    check.unhealthy_threshold = 2
    a = assignment("d1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="HEALTHY by its exec check", timeout=30)
    port = view.observed("d1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
    assert f"hello from {a.meta.id}" in await http_get(port)


async def test_the_runtime_is_docker_whenever_a_daemon_answers_and_says_why(docker_host: str, tmp_path: Path) -> None:
    missing = f"unix://{tmp_path}/no.sock"

    async def chosen(**settings: object) -> tuple[str, str]:
        choice = await choose_launcher(AgentSettings(node_id="x", **settings))  # type: ignore[arg-type]
        await choice.launcher.close()
        return choice.launcher.name, choice.reason

    assert await chosen(runtime="", docker_host=docker_host) == (
        "docker",
        f"a Docker daemon answers at {docker_host} (base image zattera/base:latest present)",
    )
    assert await chosen(runtime="", docker_host=missing) == (
        "process",
        f"no Docker daemon answers at {missing}: apps run as processes, without containers' memory and CPU limits",
    )
    assert await chosen(runtime="process", docker_host=docker_host) == (
        "process",
        "chosen by --runtime process (ZATTERA_AGENT_RUNTIME)",
    )
    with pytest.raises(DockerUnavailable, match=f"runtime docker: no Docker daemon answers at {missing}"):
        await chosen(runtime="docker", docker_host=missing)


async def test_a_daemon_without_the_base_image_gets_one_made_by_the_agent_and_runs_on_it(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer
) -> None:
    """The daemon holds no base image (nothing but the test suite ever made one): the agent makes it from the
    node's shell and busybox and uses the docker runtime (it fell back to bare processes, silently)."""
    base = f"zattera/base-made:{new_id().lower()}"
    docker = aiodocker.Docker(url=docker_host)
    try:
        agent = await start_agent("d1", runtime="", docker_host=docker_host, docker_base_image=base)
        await eventually(lambda: (n := view.node("d1")) is not None and n.runtime == "docker", what="docker runtime")
        node = view.node("d1")
        assert node is not None
        assert node.runtime_reason == f"a Docker daemon answers at {docker_host} (base image {base} made by this agent)"
        assert (await docker.images.inspect(base))["Id"]
        rel = docker_release(SERVE)  # busybox's mkdir, echo and httpd, on the base image the agent made
        a = assignment("d1", rel)
        await seed(writer, rel, a)
        await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="HEALTHY", timeout=60)
        port = view.observed("d1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
        assert f"hello from {a.meta.id}" in await http_get(port)
        note = read_runtime_note(agent.agent.data_dir)
        assert note is not None and (note.runtime, note.reason) == ("docker", node.runtime_reason)
        await set_desired(writer, view, a, pb.ASSIGNMENT_DESIRED_STOP)
        await eventually(lambda: state_of(view, "d1", a.meta.id) == STOPPED, what="stopped", timeout=30)
    finally:
        await docker.close()


async def test_a_bridged_instance_has_its_own_network_and_is_published_at_its_port(
    start_agent: StartAgent, docker_host: str, view: StateView, writer: Writer
) -> None:
    """``docker_network = "bridge"`` (the daemon makes bridge networks even with ``--iptables=false``: the
    userland proxy publishes): the instance joins the network ``zattera``, listens on every interface of its
    own network namespace, and its port is published at the node's address, where the HTTP health check and
    clients reach it as on the host network."""
    await start_docker_agent(start_agent, docker_host, docker_network="bridge")
    rel = docker_release(SERVE)
    a = assignment("d1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == HEALTHY, what="HEALTHY through the published port")
    observed = view.observed("d1", a.meta.id)
    assert observed is not None
    port = observed.mesh_port_bindings["http"]
    assert f"hello from {a.meta.id}" in await http_get(port)
    docker = aiodocker.Docker(url=docker_host)
    try:
        shown = await (await docker.containers.get(observed.container_id)).show()
    finally:
        await docker.close()
    assert shown["HostConfig"]["NetworkMode"] == "zattera"
    assert shown["HostConfig"]["PortBindings"] == {f"{port}/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(port)}]}
    assert "ZATTERA_BIND_ADDR=0.0.0.0" in shown["Config"]["Env"]


@pytest.mark.parametrize(
    ("bind", "published_at"), [("127.0.0.1", "127.0.0.1"), ("10.0.0.5", "10.0.0.5"), ("agent", "0.0.0.0")]
)
def test_a_bridged_container_listens_everywhere_inside_and_is_published_at_the_bind_address(
    bind: str, published_at: str
) -> None:
    env = {"PORT": "4000", "PORT_ADMIN": "4001", "ZATTERA_BIND_ADDR": bind, "HOST": bind, "PORTAL": "x"}
    image = ContainerImage("docker://x", Path("/"), tag="x")
    bridged = container_config(
        ["sh"], image=image, env=env, plan=LaunchPlan(), labels={}, pids_limit=0, network="zattera"
    )
    assert bridged["HostConfig"]["NetworkMode"] == "zattera"
    assert bridged["ExposedPorts"] == {"4000/tcp": {}, "4001/tcp": {}}
    assert bridged["HostConfig"]["PortBindings"]["4001/tcp"] == [{"HostIp": published_at, "HostPort": "4001"}]
    assert {"ZATTERA_BIND_ADDR=0.0.0.0", "HOST=0.0.0.0", "PORT=4000"} <= set(bridged["Env"])
    on_host = container_config(["sh"], image=image, env=env, plan=LaunchPlan(), labels={}, pids_limit=0)
    assert on_host["HostConfig"]["NetworkMode"] == "host" and "PortBindings" not in on_host["HostConfig"]
    assert f"ZATTERA_BIND_ADDR={bind}" in on_host["Env"]


async def test_auto_networking_bridges_only_off_loopback(docker_host: str) -> None:
    """``auto`` keeps the host network for a loopback mesh address (a bridged instance could not reach the
    node's loopback services) and bridges otherwise, on a daemon that makes bridge networks."""
    on_loopback = (
        await choose_launcher(
            AgentSettings(node_id="a1", runtime="docker", docker_host=docker_host, docker_network="auto")
        )
    ).launcher
    meshed = (
        await choose_launcher(
            AgentSettings(
                node_id="a2", runtime="docker", docker_host=docker_host, docker_network="auto", mesh_ip="10.0.0.5"
            )
        )
    ).launcher
    try:
        assert isinstance(on_loopback, DockerLauncher) and on_loopback.network == "host"
        assert isinstance(meshed, DockerLauncher) and meshed.network == "zattera"
    finally:
        await on_loopback.close()
        await meshed.close()
