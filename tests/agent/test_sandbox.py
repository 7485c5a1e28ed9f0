"""The process runtime's sandbox with a real agent, real NATS and real bubblewrap (``services/agent/sandbox.py``).

The spy (``tests/apps/spy``) runs as a ``process://`` app beside a victim of another environment and a host
process, both holding a secret in their environment; it must get none of it, nor the agent's files. Then
what else a sandbox must keep working: exec health checks inside it, volumes that are the environment's
own, exit codes, a secured agent that refuses to run apps unisolated, and build steps: sandboxed as the app's
build user, and no link they plant is followed by the builder afterwards; snapshot pre-hooks sandboxed too.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.agent import node_runtime
from services.agent.builder import Builder
from services.agent.sandbox import NONE, SANDBOX, IsolationRefused, Sandbox, hook_runner, probe_now
from services.agent.sandbox_users import UidTable
from services.agent.settings import AgentSettings
from services.agent.snapshots.handlers import PreHookError
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, process_ref, release
from tests.agent.test_builder import run_build, serving
from tests.agent.test_runtime import seed, state_of
from tests.waiting import eventually

SPY = Path(__file__).resolve().parents[1] / "apps" / "spy"

pytestmark = pytest.mark.skipif(
    not probe_now().ok and os.environ.get("CI") != "true", reason=f"no sandbox here: {probe_now().problem}"
)


def exec_ref(command: str) -> str:
    return "exec:" + quote(command, safe="")


def output(data_dir: Path, assignment_id: str, stream: str = "stdout") -> str:
    path = data_dir / "instances" / assignment_id / f"{stream}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def spy_report(data_dir: Path, assignment_id: str) -> dict[str, object]:
    for line in output(data_dir, assignment_id).splitlines():
        if line.startswith("SPY-REPORT "):
            return dict(json.loads(line.removeprefix("SPY-REPORT ")))
    return {}


async def test_the_spy_gets_nothing_of_the_agent_other_apps_or_the_host(
    start_agent: StartAgent, view: StateView, writer: Writer, tmp_path: Path, nats_url: str
) -> None:
    data_dir = tmp_path / "agent-n1"
    running = await start_agent("n1", data_dir=data_dir)
    assert running.agent.node is not None and running.agent.node.isolation == SANDBOX
    (data_dir / "node.creds").write_text("NODE-CREDENTIAL")  # what a joined node keeps there
    secret = f"secret-{secrets.token_hex(8)}"
    host = await asyncio.create_subprocess_exec("sleep", "120", env={"HOST_TOKEN": secret})  # a host process
    try:
        victim = release(exec_ref("exec sleep 120"), env_id="VICTIM", healthcheck=False)
        victim.service.vars["VICTIM_TOKEN"] = secret
        victim_a = assignment("n1", victim)
        spy_dir = tmp_path / "spy"
        shutil.copytree(SPY, spy_dir)
        spy = release(process_ref(spy_dir, f"{sys.executable} spy.py"), env_id="SPY", healthcheck=False)
        spy.service.vars.update(
            SPY_PATHS=f"{data_dir}:{data_dir / 'node.creds'}:{tmp_path / 'nats'}",
            SPY_NATS=nats_url.removeprefix("nats://"),
            SPY_SOCKETS="/var/run/docker.sock,/run/docker.sock",
        )
        spy_a = assignment("n1", spy)
        await seed(writer, victim, victim_a)
        await eventually(lambda: state_of(view, "n1", victim_a.meta.id) == pb.INSTANCE_STATE_HEALTHY, what="victim")
        await seed(writer, spy, spy_a)
        await eventually(lambda: bool(spy_report(data_dir, spy_a.meta.id)), what="the spy report", timeout=30)
    finally:
        host.kill()
        await host.wait()

    report = spy_report(data_dir, spy_a.meta.id)
    text = json.dumps(report)
    assert secret not in text and "NODE-CREDENTIAL" not in text
    files = report["files"]
    assert isinstance(files, dict)
    assert all(not p.startswith(str(data_dir)) for p in files["read"]), files["read"]
    assert files["listed"].get(str(data_dir)) in (None, [])  # the agent's data dir: covered, empty
    proc = report["proc"]
    assert isinstance(proc, dict) and len(proc["pids"]) <= 4, proc["pids"]  # bwrap's pid 1, the spy's own
    assert report["docker"] == {
        "/var/run/docker.sock": "unreachable: [Errno 2] No such file or directory",
        "/run/docker.sock": "unreachable: [Errno 2] No such file or directory",
    }
    identity = report["identity"]
    assert isinstance(identity, dict)
    assert identity["status"]["CapEff"] == "0000000000000000" and identity["status"]["NoNewPrivs"] == "1"
    victim_uid = next(p.uids().real for p in _sleepers(victim_a.meta.id))
    assert identity["uid"] != victim_uid and 0 not in (identity["uid"], victim_uid)  # a user per environment


def _sleepers(assignment_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["environ", "name"]):
        environ = proc.info["environ"] or {}
        if proc.info["name"] == "sleep" and environ.get("ZATTERA_ASSIGNMENT_ID") == assignment_id:
            found.append(proc)
    return found


async def test_an_exec_health_check_runs_inside_the_instances_sandbox_as_its_user(
    start_agent: StartAgent, view: StateView, writer: Writer
) -> None:
    """The app marks itself ready in its private /tmp; only a check run inside its sandbox sees the mark, and it
    runs as the app's user (it can write where the app can)."""
    await start_agent("n1")
    rel = release(exec_ref("touch /tmp/ready; exec sleep 120"))
    rel.service.healthcheck.type = pb.HEALTH_CHECK_TYPE_EXEC
    rel.service.healthcheck.command = 'test -f /tmp/ready && [ "$(id -u)" != 0 ] && touch mine && test -O mine'
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == pb.INSTANCE_STATE_HEALTHY, what="HEALTHY")


async def test_a_volume_belongs_to_its_environments_user(
    start_agent: StartAgent, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    data_dir = tmp_path / "agent-n1"
    await start_agent("n1", data_dir=data_dir)
    writes = 'echo kept > "$ZATTERA_VOLUME_DATA/file"; id -u > "$ZATTERA_VOLUME_DATA/uid"; exec sleep 120'
    rel = release(exec_ref(writes), healthcheck=False)
    rel.service.stateful = True
    rel.service.volumes.add(volume_name="data", mount_path="/data")
    a = assignment("n1", rel)
    volume = pb.Volume(project_id="P1", environment_id="E1", name="data", node_id="n1")
    volume.meta.id = "V1"
    volume.status = pb.VOLUME_STATUS_ACTIVE
    volume.lease.node_id = "n1"
    volume.lease.assignment_id = a.meta.id
    volume.lease.expires_at.GetCurrentTime()
    volume.lease.expires_at.seconds += 120
    await seed(writer, volume, rel, a)
    file, written = data_dir / "volumes" / "V1" / "file", data_dir / "volumes" / "V1" / "uid"
    await eventually(lambda: written.exists() and written.read_text().endswith("\n"), what="written in the volume")
    uid = int(written.read_text())
    assert file.read_text() == "kept\n"
    assert uid != 0 and (data_dir / "volumes" / "V1").stat().st_uid == uid == file.stat().st_uid


@pytest.mark.parametrize(
    ("command", "code", "signal"), [("exit 3", 3, 0), ("kill -KILL $$", 0, 9)], ids=["code", "signal"]
)
async def test_an_instances_exit_is_reported_as_a_bare_process_would_be(
    start_agent: StartAgent, view: StateView, writer: Writer, command: str, code: int, signal: int
) -> None:
    await start_agent("n1", max_start_attempts=1)
    rel = release(exec_ref(command), healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == pb.INSTANCE_STATE_FAILED, what="FAILED")
    observed = view.observed("n1", a.meta.id)
    assert observed is not None
    assert (observed.last_exit.code, observed.last_exit.signal) == (code, signal), observed.last_exit


async def test_a_secured_agent_refuses_to_run_apps_unisolated_unless_told_to(
    start_agent: StartAgent, conn: Connection, tmp_path: Path
) -> None:
    cannot = {"node_id": "n9", "runtime": "process", "sandbox_bwrap": "/nonexistent/bwrap"}
    with pytest.raises(IsolationRefused, match="--allow-unisolated-apps"):
        await node_runtime(AgentSettings(**cannot), tmp_path / "n9", secured=True)  # type: ignore[arg-type]
    allowed_settings = AgentSettings(**cannot, allow_unisolated=True)  # type: ignore[arg-type]
    allowed = await node_runtime(allowed_settings, tmp_path / "n9", secured=True)
    assert (allowed.isolation.kind, allowed.sandbox) == (NONE, None)
    # An open cluster's agent runs them, and says so in its node record (`zattera nodes list`).
    running = await start_agent("n9", sandbox_bwrap="/nonexistent/bwrap")
    assert running.agent.node is not None
    assert running.agent.node.isolation == NONE
    assert "bubblewrap is not installed" in running.agent.node.isolation_problem


@pytest.fixture
async def sandboxed_builder(conn: Connection, tmp_path: Path) -> AsyncIterator[Builder]:
    (tmp_path / "agent").mkdir(mode=0o700)
    uids = UidTable(tmp_path / "agent" / "sandbox", base=0x70000000, count=65536)
    sandbox = Sandbox(probe_now(), uids, hidden=(tmp_path / "agent",))
    builder = Builder(conn, "b1", tmp_path / "agent" / "builds", os_arch="linux/amd64", sandbox=sandbox)
    async with serving(builder):
        yield builder


async def test_build_steps_run_sandboxed_as_the_apps_build_user(
    sandboxed_builder: Builder, conn: Connection, tmp_path: Path
) -> None:
    (tmp_path / "agent" / "node.creds").write_text("NODE-CREDENTIAL")
    spy = f"id -u; cat {tmp_path / 'agent' / 'node.creds'} || echo creds-unreadable; ls /proc | grep -c '^[0-9]'"
    manifest = f'[build]\ncommand = "{spy}"\n\n[run]\ncommand = "true"\n'
    events = await run_build(conn, {"zattera.toml": manifest})
    lines = [e.log.line for e in events if e.log.line]
    assert not any(e.error for e in events), lines
    uid = int(lines[lines.index(f"$ {spy}") + 1])
    assert uid >= 0x70000000 and "creds-unreadable" in lines and "NODE-CREDENTIAL" not in lines
    assert int(lines[lines.index("creds-unreadable") + 1]) <= 4  # bwrap's pid 1, the shell, ls, grep
    assert sandboxed_builder.sandbox is not None
    assert sandboxed_builder.sandbox.uids.keys() == {"build:p1/a1"}


async def test_a_link_the_install_step_plants_is_not_followed_by_the_builder(conn: Connection, tmp_path: Path) -> None:
    """The install step (the app's code) makes ``.zattera/bin`` a link to a directory of the node; the builder,
    writing its interpreter shims there afterwards as root, must not write through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    manifest = f'[build]\ninstall = "mkdir -p .zattera && ln -s {outside} .zattera/bin"\n\n[run]\ncommand = "true"\n'
    async with serving(Builder(conn, "b1", tmp_path / "builds", os_arch="linux/amd64")):
        events = await run_build(conn, {"requirements.txt": "", "zattera.toml": manifest})
    assert not any(e.error for e in events), [e.log.line for e in events]
    assert list(outside.iterdir()) == []


async def test_a_snapshot_pre_hook_runs_sandboxed_as_the_volumes_environments_user(tmp_path: Path) -> None:
    """The operator's command runs in the volume the app wrote: a link the app planted there to the node's
    credential leads nowhere."""
    root = tmp_path / "agent"
    volume = root / "volumes" / "V1"
    volume.mkdir(parents=True)
    root.chmod(0o700)
    (root / "node.creds").write_text("NODE-CREDENTIAL")
    (volume / "planted").symlink_to(root / "node.creds")
    sandbox = Sandbox(probe_now(), UidTable(root / "sandbox", base=0x70000000, count=65536), hidden=(root,))
    run = hook_runner(sandbox, lambda _: sandbox.uid("env:E1"))
    await run(
        'cat planted > copied || echo unreadable > copied; id -u > who; echo "$ZATTERA_ASSIGNMENT_ID" > aid',
        "A1",
        volume,
    )
    assert (volume / "copied").read_text() == "unreadable\n"
    assert int((volume / "who").read_text()) == sandbox.uid("env:E1") == (volume / "who").stat().st_uid
    assert (volume / "aid").read_text() == "A1\n"
    with pytest.raises(PreHookError, match="pre-hook exited 3"):
        await run("exit 3", "A1", volume)
