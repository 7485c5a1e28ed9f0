"""The reference's hazards, fixed, checked on real NATS: transitions are single atomic fenced batches,
a refused batch writes nothing, cancel works on both sides of promotion, ownership returns to the
scheduler at promotion."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, deployment_of
from services.orchestrator.phases import decide
from shared import keys as K
from shared.connection import Connection
from shared.deploy import Deployer
from shared.deployments import env_ownership
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.txn import Conflict, Writer
from tests.orchestrator.rig import PH, RUN, STOP, Rig, copied, make_rig, seed_deploy_rig

HEALTHY = pb.INSTANCE_STATE_HEALTHY
FAILED = pb.INSTANCE_STATE_FAILED


@pytest.fixture
async def rig(conn: Connection) -> AsyncIterator[Rig]:
    async with make_rig(conn) as r:
        await seed_deploy_rig(r)
        yield r


async def last_seq(conn: Connection, key: str) -> int:
    msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + key, direct=True)
    return int(msg.seq or 0)


async def assert_one_batch(conn: Connection, keys: list[str]) -> None:
    """The keys' last writes are consecutive stream messages closed by the orchestrator's lease re-write:
    one atomic batch, fenced."""
    seqs = sorted([await last_seq(conn, k) for k in keys])
    lease_seq = await last_seq(conn, K.lease("orchestrator"))
    assert [*seqs, lease_seq] == list(range(seqs[0], seqs[0] + len(keys) + 1))


async def test_abort_is_one_fenced_batch_deleting_green_and_failing(conn: Connection, rig: Rig) -> None:
    await rig.steps(2)
    green = rig.green()
    await rig.observe(green[:1], FAILED)
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_FAILED
    await assert_one_batch(conn, [K.deployment("dep1"), *(K.assignment(a.node_id, a.meta.id) for a in green)])


async def test_promotion_is_one_fenced_batch_of_env_and_draining_old(conn: Connection, rig: Rig) -> None:
    await rig.steps(2)
    await rig.observe(rig.green(), HEALTHY)
    await rig.steps(2)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_PROMOTING
    before = rig.env().route_generation
    await rig.step()
    d = rig.deployment()
    assert d.phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    assert d.HasField("promoted_at") and d.HasField("drain_deadline")
    assert rig.env().active_release_id == "rel2" and rig.env().route_generation == before + 1
    await assert_one_batch(conn, [K.env(rig.env_id), K.deployment("dep1")])


async def test_an_abort_refused_by_a_concurrent_change_writes_nothing(conn: Connection, rig: Rig) -> None:
    await rig.steps(2)
    green = rig.green()
    await rig.observe(green[:1], FAILED)
    transition = decide(rig.view, rig.deployment(), rig.clock.now(), Timers())
    assert transition is not None and deployment_of(transition).phase == PH.DEPLOYMENT_PHASE_FAILED
    txn = transition.txn(rig.writer)

    other_view = StateView(conn, name="operator")
    await other_view.start()
    cancel = copied(other_view.deployment("dep1"))
    assert cancel is not None
    cancel.error = "canceled by operator"
    await Writer(conn, other_view).commit(Writer(conn, other_view).txn().put(cancel))
    await other_view.stop()

    assert rig.orchestrator.writer is not None
    with pytest.raises(Conflict):
        await rig.orchestrator.writer.commit(txn)
    fresh = StateView(conn, name="fresh")
    await fresh.start()
    fresh_d = fresh.deployment("dep1")
    assert fresh_d is not None and fresh_d.phase == PH.DEPLOYMENT_PHASE_STARTING
    assert len([a for a in fresh.assignments(rig.env_id) if a.deployment_id == "dep1"]) == 2
    await fresh.stop()


async def test_cancel_before_promotion_fails_with_green_removed_and_traffic_untouched(rig: Rig) -> None:
    await rig.steps(2)
    assert len(rig.green()) == 2
    await Deployer(rig.writer, clock=rig.clock).cancel("dep1")
    await rig.step()
    d = rig.deployment()
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED and d.error == "canceled by operator"
    assert [a for a in rig.view.assignments(rig.env_id) if a.deployment_id == "dep1"] == []
    assert rig.env().active_release_id == "rel1"
    assert [a.desired for a in rig.blue()] == [RUN, RUN]


async def test_cancel_while_draining_completes_the_drain_early(rig: Rig) -> None:
    await rig.steps(2)
    await rig.observe(rig.green(), HEALTHY)
    await rig.steps(3)
    assert rig.phase() == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    assert await rig.step() is None  # the drain window is still open
    await rig.clock.advance(5)
    await Deployer(rig.writer, clock=rig.clock).cancel("dep1")
    await rig.step()
    assert rig.phase() == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert rig.deployment().error == ""
    assert rig.env().active_release_id == "rel2"
    assert [a.desired for a in rig.blue()] == [STOP, STOP]


async def test_once_promoted_the_scheduler_owns_the_env_except_the_warm_blue(rig: Rig) -> None:
    await rig.steps(2)
    assert not env_ownership(rig.view, rig.env_id).scheduler_manages
    await rig.observe(rig.green(), HEALTHY)
    await rig.steps(3)
    ownership = env_ownership(rig.view, rig.env_id)
    assert ownership.scheduler_manages
    assert ownership.held_release_ids == frozenset({"rel1"})
