"""Volume snapshots under ``--secure``: the CLI (operator credential) snapshots and restores through a node
agent holding only its agent credential, and the scheduler's prune runs on that agent, all against a real
secured nats-server. Before the fix the operator could not publish ``zattera.agent.<node>.snapshot`` /
``.restore`` and the agent could not purge object-store chunks (nats-py's object delete)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.chunking import TEST_PARAMS
from services.agent.snapshots.handlers import SnapshotAgent
from services.agent.snapshots.tarstream import tar_bytes
from shared.clock import FakeClock
from shared.connection import Connection, connect
from shared.security.join import JoinService
from shared.security.permissions import Role
from shared.snapshots.dispatch import SnapshotDispatcher
from shared.snapshots.store import SnapshotStore
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM, agent_subject
from shared.txn import Writer
from shared.watches import watch_opener
from tests import factories
from tests.security.conftest import ConnectAs, SecureCluster
from tests.snapshots.conftest import BASE, snap_volume, write_tree

NODE = "snap-node"


@dataclass
class Side:
    """One role's connection with its own state view and (unfenced) writer."""

    conn: Connection
    view: StateView
    writer: Writer


async def _side(secure: SecureCluster, role: Role, name: str) -> Side:
    conn = await connect(secure.url, name=f"test-{name}", creds=secure.creds(role, name))
    # The operator creates no consumer: it follows a watch control opens, as the CLI does.
    view = StateView(conn, name=name, open_consumer=watch_opener(conn) if role is Role.OPERATOR else None)
    await view.start(timeout=10)
    return Side(conn, view, Writer(conn, view))


@pytest.fixture
async def sides(secure: SecureCluster, watches: None) -> AsyncIterator[tuple[Side, Side]]:
    """(control, operator): the scheduler's credential and the CLI's."""
    control = await _side(secure, Role.CONTROL, "control")
    operator = await _side(secure, Role.OPERATOR, "cli")
    try:
        yield control, operator
    finally:
        for side in (operator, control):
            await side.view.stop()
            await side.conn.close()


@pytest.fixture
async def node_agent(secure: SecureCluster, tmp_path: Path) -> AsyncIterator[SnapshotAgent]:
    """The node's snapshot service on the node's own agent credential (name = node id), no GC grace."""
    conn = await connect(secure.url, name="test-agent", creds=secure.creds(Role.AGENT, NODE))
    agent = SnapshotAgent(conn, NODE, tmp_path / "volumes", params=TEST_PARAMS, heartbeat=0.2, gc_grace=0)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()
        await conn.close()


async def test_operator_snapshots_and_restores_and_the_agent_prunes_on_a_secured_cluster(
    sides: tuple[Side, Side], node_agent: SnapshotAgent, join_service: JoinService, tmp_path: Path
) -> None:
    control, operator = sides
    clock = FakeClock(BASE)
    volume = snap_volume("secvol", node_id=NODE)
    await control.writer.commit(control.writer.txn().put(factories.node(NODE)).put(volume))
    root = node_agent.volumes_root / volume.meta.id
    write_tree(root, {"db": random.randbytes(96 << 10), "conf": b"v1"})
    expected = tar_bytes(root)
    await operator.view.wait_fresh()

    # `zattera volumes snapshot` with the operator credential: the agent answers on the node's subject.
    cli = SnapshotDispatcher(operator.conn, operator.view, clock, first_reply_timeout=3.0, idle_timeout=10.0)
    first = await cli.snapshot(volume, operator.writer)
    assert first.status == pb.SNAPSHOT_STATUS_COMPLETE, first.error
    write_tree(root, {"db": random.randbytes(96 << 10), "conf": b"v2"})
    second = await cli.snapshot(volume, operator.writer)
    assert second.status == pb.SNAPSHOT_STATUS_COMPLETE, second.error

    # `zattera volumes restore` with the operator credential rebuilds the first one.
    await operator.view.wait_fresh()
    await cli.restore(volume.meta.id, first.meta.id, operator.writer)
    assert tar_bytes(root) == expected
    assert operator.view.volume(volume.meta.id).status == pb.VOLUME_STATUS_ACTIVE  # type: ignore[union-attr]

    # Retention drops the first snapshot; the scheduler (control) prunes it on the node's agent, which deletes
    # its manifest and the chunks only it referenced (nats-py's object delete purges the object's chunks).
    await control.writer.commit(control.writer.txn().delete(f"snapshot.{first.meta.id}"))
    await control.view.wait_fresh()
    scheduler = SnapshotDispatcher(control.conn, control.view, clock)
    pruned = await scheduler.prune(volume, [first.meta.id])
    assert pruned.error == ""
    assert pruned.deleted_manifests == 1 and pruned.deleted_chunks > 0
    store = await SnapshotStore.open(control.conn.js)
    assert [m.name for m in await store.list("manifests/")] == [f"manifests/{second.meta.id}"]


@pytest.mark.parametrize("verb", ["build", "prune"])
async def test_operator_may_not_ask_a_node_to_build_or_prune(connect_as: ConnectAs, verb: str) -> None:
    """Only snapshot and restore were opened to the CLI: builds are dispatched and prunes run by the services."""
    operator = await connect_as(Role.OPERATOR, "cli")
    subject = agent_subject(NODE, verb)
    await operator.nc.publish(subject, b"", reply=operator.nc.new_inbox())
    assert await operator.refusal() == f'nats: permissions violation for publish to "{subject}"'


async def test_a_request_redirected_through_a_jetstream_reply_is_not_acted_on(
    secure: SecureCluster, connect_as: ConnectAs, join_service: JoinService, tmp_path: Path
) -> None:
    """Agent n1 names n2's snapshot subject as the reply of its direct get: the answer comes back through the
    import into AGENTS, where n2 listens — as a message without a reply subject, which n2 does not act on,
    so the pre-hook in those bytes never runs."""
    victim_conn = await connect(secure.url, name="victim", creds=secure.creds(Role.AGENT, "n2"))
    victim = SnapshotAgent(victim_conn, "n2", tmp_path / "volumes", params=TEST_PARAMS, heartbeat=0.2)
    await victim.start()
    try:
        volume = snap_volume("vol-redirect", node_id="n2")
        write_tree(tmp_path / "volumes" / volume.meta.id, {"f": b"x"})
        marker = tmp_path / "pwned"
        forged = cpb.SnapshotVolumeRequest(volume=volume, pre_hook_command=f"touch {marker}")
        forged.snapshot.meta.id = "forged"
        attacker = await connect_as(Role.AGENT, "n1")
        own = f"{STATE_PREFIX}observed.n1.redirect-hook"
        await attacker.nc.jetstream().publish(own, forged.SerializeToString())
        direct_get = f"$JS.API.DIRECT.GET.{STATE_STREAM}.{own}"
        await attacker.nc.publish(direct_get, b"", reply=agent_subject("n2", "snapshot"))
        await attacker.nc.flush()
        for _ in range(50):
            assert not marker.exists(), "a redirected message ran the pre-hook"
            await asyncio.sleep(0.02)
    finally:
        await victim.stop()
        await victim_conn.close()
