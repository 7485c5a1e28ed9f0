"""Node registration: first registration and re-registration semantics (reference §1.1)."""

from __future__ import annotations

from pathlib import Path

import psutil
from zattera.v1 import types_pb2 as pb

from services.agent.registration import NodeIdentity, register_node, registered_node
from shared.clock import FakeClock
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer
from tests.waiting import eventually


def identity(tmp_path: Path, *, builder: bool = True, labels: dict[str, str] | None = None) -> NodeIdentity:
    return NodeIdentity.from_host(
        "n1", tmp_path, labels=labels or {"zone": "a"}, roles=["worker", "control"], builder=builder
    )


async def test_registers_alive_schedulable_with_host_capacity_and_self_asserted_labels(
    conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    me = identity(tmp_path)
    await register_node(conn, writer, me, FakeClock())

    await eventually(lambda: view.node("n1") is not None, what="node visible")
    node = view.node("n1")
    assert node is not None
    assert node.status == pb.NODE_STATUS_ALIVE and node.schedulable
    assert node.capacity.cpu_millis == (psutil.cpu_count() or 1) * 1000
    assert node.capacity.memory_mb == psutil.virtual_memory().total // (1024 * 1024)
    assert node.os_arch == me.os_arch and "/" in node.os_arch
    assert dict(node.labels) == {"zone": "a", "zattera.dev/os-arch": me.os_arch, "builder": "true"}
    assert list(node.roles) == [pb.NODE_ROLE_WORKER, pb.NODE_ROLE_CONTROL]


async def test_re_registration_keeps_cordon_and_operator_labels_and_resets_status(
    conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await register_node(conn, writer, identity(tmp_path), FakeClock())
    stored = view.node("n1")
    assert stored is not None
    operated = pb.Node()
    operated.CopyFrom(stored)
    operated.schedulable = False
    operated.status = pb.NODE_STATUS_DOWN
    operated.labels["team"] = "payments"
    operated.labels["builder"] = "false"
    await writer.commit(writer.txn().put(operated))

    await register_node(conn, writer, identity(tmp_path), FakeClock())

    node = view.node("n1")
    assert node is not None
    assert node.status == pb.NODE_STATUS_ALIVE
    assert not node.schedulable
    assert node.labels["team"] == "payments" and node.labels["zone"] == "a"
    assert node.labels["builder"] == "false", "an operator's builder=false survives a restart"


def test_a_non_builder_drops_the_builder_label_it_asserted_before(tmp_path: Path) -> None:
    before = registered_node(identity(tmp_path, builder=True), None, 0.0)
    after = registered_node(identity(tmp_path, builder=False), before, 1.0)
    assert before.labels["builder"] == "true"
    assert "builder" not in after.labels
