"""The process runtime end to end: real NATS, real agent, real app processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.processes import InstanceRecord
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection
from shared.live import node_key
from shared.state.feed import StateView
from shared.subjects import LIVE_PREFIX, LIVE_STREAM
from shared.txn import Writer
from tests.agent.conftest import StartAgent, app_ref, assignment, release
from tests.waiting import eventually

HEALTHY = pb.INSTANCE_STATE_HEALTHY
STOPPED = pb.INSTANCE_STATE_STOPPED
FAILED = pb.INSTANCE_STATE_FAILED
PENDING = pb.INSTANCE_STATE_PENDING
STARTING = pb.INSTANCE_STATE_STARTING


def state_of(view: StateView, node_id: str, assignment_id: str) -> int:
    observed = view.observed(node_id, assignment_id)
    return observed.state if observed is not None else pb.INSTANCE_STATE_UNSPECIFIED


async def http_get(port: int, host: str = "127.0.0.1") -> str:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
    await writer.drain()
    response = await reader.read()
    writer.close()
    return response.decode()


async def answers(port: int) -> bool:
    try:
        return "hello" in await http_get(port)
    except OSError:
        return False


async def seed(writer: Writer, *objects: pb.Release | pb.Assignment | pb.Volume) -> None:
    txn = writer.txn("seed")
    for obj in objects:
        txn.put(obj)
    await writer.commit(txn)


async def set_desired(writer: Writer, view: StateView, a: pb.Assignment, desired: int) -> None:
    stored = view.assignment(a.meta.id)
    assert stored is not None
    flipped = pb.Assignment()
    flipped.CopyFrom(stored)
    flipped.desired = desired  # type: ignore[assignment]
    await writer.commit(writer.txn().put(flipped))


async def test_run_becomes_healthy_reports_port_and_samples_then_stops_with_sigterm(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer, app_dir: Path
) -> None:
    await start_agent("n1")
    rel = release(app_ref(app_dir))
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    await eventually(lambda: state_of(view, "n1", a.meta.id) == HEALTHY, what="HEALTHY")
    observed = view.observed("n1", a.meta.id)
    assert observed is not None
    port = observed.mesh_port_bindings["http"]
    assert port > 0
    assert f"hello from {a.meta.id}" in await http_get(port)

    async def heartbeat_has_sample() -> bool:
        msg = await conn.js.get_last_msg(LIVE_STREAM, LIVE_PREFIX + node_key("n1"))
        hb = cpb.Heartbeat.FromString(msg.data or b"")
        return hb.node_id == "n1" and hb.memory_total_bytes > 0 and hb.instances[a.meta.id].memory_bytes > 0

    await eventually(heartbeat_has_sample, what="a heartbeat with the instance's sample")

    await set_desired(writer, view, a, pb.ASSIGNMENT_DESIRED_STOP)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == STOPPED, what="STOPPED")
    assert (app_dir / f"sigterm-{a.meta.id}").read_text() == "SIGTERM"
    stopped = view.observed("n1", a.meta.id)
    assert stopped is not None and not stopped.mesh_port_bindings


async def test_the_instance_is_told_to_bind_the_nodes_mesh_address_and_probed_there(
    start_agent: StartAgent, view: StateView, writer: Writer, app_dir: Path
) -> None:
    """A second node on the same machine (mesh 127.0.0.2) runs its replicas at the address its
    routes list; the health check reaches them there."""
    await start_agent("n2", mesh_ip="127.0.0.2")
    rel = release(app_ref(app_dir))
    a = assignment("n2", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n2", a.meta.id) == HEALTHY, what="HEALTHY, probed at 127.0.0.2")
    observed = view.observed("n2", a.meta.id)
    assert observed is not None
    port = observed.mesh_port_bindings["http"]
    assert f"hello from {a.meta.id}" in await http_get(port, "127.0.0.2")
    assert not await answers(port), "bound to the mesh address only, not to 127.0.0.1"


async def test_vanished_assignment_is_removed_with_its_observed_key(
    start_agent: StartAgent, view: StateView, writer: Writer, app_dir: Path, tmp_path: Path
) -> None:
    await start_agent("n1")
    rel = release(app_ref(app_dir), healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == HEALTHY, what="HEALTHY without a healthcheck")
    port = view.observed("n1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
    await eventually(lambda: answers(port), what="the app answers (its SIGTERM handler is set)")
    instance_dir = tmp_path / "agent-n1" / "instances" / a.meta.id
    record = InstanceRecord.load(instance_dir)
    assert record is not None and psutil.pid_exists(record.pid)

    await writer.commit(writer.txn().delete(K.assignment("n1", a.meta.id)))
    await eventually(lambda: view.observed("n1", a.meta.id) is None, what="observed key deleted")
    await eventually(lambda: not instance_dir.exists(), what="instance directory removed")
    assert (app_dir / f"sigterm-{a.meta.id}").exists()
    assert not psutil.pid_exists(record.pid) or psutil.Process(record.pid).status() == psutil.STATUS_ZOMBIE


async def test_crash_loop_is_failed_after_three_starts(
    start_agent: StartAgent, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await start_agent("n1")
    rel = release("exec:exit%203")
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    await eventually(lambda: state_of(view, "n1", a.meta.id) == FAILED, what="FAILED")
    observed = view.observed("n1", a.meta.id)
    assert observed is not None
    assert observed.exit_code == 3
    assert observed.restarts == 2
    assert "gave up after 3 failed starts" in observed.message


async def test_restarts_back_off_on_the_agents_clock(start_agent: StartAgent, view: StateView, writer: Writer) -> None:
    """The backoff is measured on the injected clock: a minute-long backoff passes when the clock is moved."""
    clock = FakeClock()
    await start_agent("n1", clock=clock, restart_backoff=60.0, restart_backoff_max=600.0)
    rel = release("exec:exit%203", healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    def reported(state: int, restarts: int, message: str) -> bool:
        observed = view.observed("n1", a.meta.id)
        return (
            observed is not None
            and (observed.state, observed.restarts) == (state, restarts)
            and message in observed.message
        )

    await eventually(lambda: reported(STARTING, 0, "restarting in 60.0s"), what="first crash: backing off 60 s")
    await clock.advance(60.0)
    await eventually(lambda: reported(STARTING, 1, "restarting in 120.0s"), what="second crash: backing off 120 s")
    await clock.advance(120.0)
    await eventually(lambda: reported(FAILED, 2, "gave up after 3 failed starts"), what="FAILED")


async def test_config_drift_recreates_the_process(
    start_agent: StartAgent, view: StateView, writer: Writer, app_dir: Path
) -> None:
    await start_agent("n1")
    rel = release(app_ref(app_dir))
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == HEALTHY, what="HEALTHY")
    first = view.observed("n1", a.meta.id)
    assert first is not None

    stored = view.assignment(a.meta.id)
    assert stored is not None
    drifted = pb.Assignment()
    drifted.CopyFrom(stored)
    drifted.config_hash = "cfg-2"
    await writer.commit(writer.txn().put(drifted))

    def recreated() -> bool:
        observed = view.observed("n1", a.meta.id)
        return observed is not None and observed.container_id != first.container_id and observed.state == HEALTHY

    await eventually(recreated, what="a new process HEALTHY")
    assert (app_dir / f"sigterm-{a.meta.id}").exists()
    assert view.observed("n1", a.meta.id).mesh_port_bindings == first.mesh_port_bindings  # type: ignore[union-attr]


async def test_restarted_agent_adopts_its_process_and_cleans_up_the_rest(
    start_agent: StartAgent, view: StateView, writer: Writer, app_dir: Path, tmp_path: Path
) -> None:
    first = await start_agent("n1", stop_on_exit=False)
    rel = release(app_ref(app_dir))
    kept, dropped = assignment("n1", rel), assignment("n1", rel)
    await seed(writer, rel, kept, dropped)
    await eventually(
        lambda: state_of(view, "n1", kept.meta.id) == HEALTHY and state_of(view, "n1", dropped.meta.id) == HEALTHY,
        what="both HEALTHY",
    )
    instances = tmp_path / "agent-n1" / "instances"
    kept_record = InstanceRecord.load(instances / kept.meta.id)
    dropped_record = InstanceRecord.load(instances / dropped.meta.id)
    assert kept_record is not None and dropped_record is not None
    container_id = view.observed("n1", kept.meta.id).container_id  # type: ignore[union-attr]

    await first.stop()
    assert psutil.pid_exists(kept_record.pid), "instances outlive the agent"
    await writer.commit(writer.txn().delete(K.assignment("n1", dropped.meta.id)))

    second = await start_agent("n1")
    await eventually(lambda: view.observed("n1", dropped.meta.id) is None, what="vanished one's report deleted")
    assert (app_dir / f"sigterm-{dropped.meta.id}").exists()
    assert not (instances / dropped.meta.id).exists()

    runtime = second.agent.runtime
    assert runtime is not None
    await eventually(lambda: kept.meta.id in runtime.running(), what="kept one adopted")
    assert runtime.running()[kept.meta.id].pid == kept_record.pid
    assert view.observed("n1", kept.meta.id).container_id == container_id  # type: ignore[union-attr]
    assert state_of(view, "n1", kept.meta.id) == HEALTHY

    await set_desired(writer, view, kept, pb.ASSIGNMENT_DESIRED_STOP)
    await eventually(lambda: state_of(view, "n1", kept.meta.id) == STOPPED, what="adopted one STOPPED")
    assert (app_dir / f"sigterm-{kept.meta.id}").exists()


async def test_stateful_instance_waits_pending_for_its_volume_lease(
    start_agent: StartAgent, view: StateView, writer: Writer, app_dir: Path, tmp_path: Path
) -> None:
    await start_agent("n1")
    rel = release(app_ref(app_dir))
    rel.service.stateful = True
    rel.service.volumes.add(volume_name="data", mount_path="/data")
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == PENDING, what="PENDING without a lease")
    assert "volume data" in view.observed("n1", a.meta.id).message  # type: ignore[union-attr]

    volume = pb.Volume(project_id="P1", environment_id="E1", name="data", node_id="n1")
    volume.meta.id = "V1"
    volume.status = pb.VOLUME_STATUS_ACTIVE
    volume.lease.node_id = "n1"
    volume.lease.assignment_id = a.meta.id
    volume.lease.expires_at.GetCurrentTime()
    volume.lease.expires_at.seconds += 60
    await seed(writer, volume)

    await eventually(lambda: state_of(view, "n1", a.meta.id) == HEALTHY, what="HEALTHY under the lease")
    written = tmp_path / "agent-n1" / "volumes" / "V1" / "written-by-app"
    assert written.read_text() == a.meta.id
