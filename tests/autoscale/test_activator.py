"""Activator on real NATS: the reference cases over ``zattera.activate``, error replies, and the
cluster-wide single flight through the fenced write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.autoscale.activator import Activator
from shared.activation import NOT_FOUND, ActivateError, request_activation
from shared.clock import FakeClock
from shared.connection import Connection
from shared.state.feed import StateView
from shared.subjects import ACTIVATE_SUBJECT
from shared.txn import Writer
from tests.autoscale.conftest import Harness, InterleavingWriter
from tests.autoscale.helpers import base_objects, scaled_env
from tests.waiting import eventually


async def _answers(conn: Connection) -> bool:
    try:
        await request_activation(conn, "probe", timeout=0.2)
    except ActivateError:
        return True
    except Exception:
        return False
    return True


@pytest.fixture
async def served(conn: Connection, view: StateView, clock: FakeClock) -> AsyncIterator[Activator]:
    activator = Activator(conn=conn, view=view, writer=Writer(conn, view), clock=clock)
    task = asyncio.create_task(activator.serve())
    # Subscribed once a request gets any reply (an unknown env's error reply will do).
    await eventually(lambda: _answers(conn), what="activator subscribed")
    try:
        yield activator
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_wakes_a_cold_env_then_is_idempotent(h: Harness, served: Activator):
    await h.seed(*base_objects(scaled_env("e1", scale_to_zero=True, min_replicas=2, max_replicas=5)))
    reply = await request_activation(h.conn, "e1", "n1")
    assert reply.accepted
    await eventually(lambda: h.env("e1").effective_replicas == 2)
    again = await request_activation(h.conn, "e1")
    assert again.accepted
    assert served.wakes == 1


async def test_unknown_env_is_an_error_and_a_non_s2z_env_is_not_accepted(h: Harness, served: Activator):
    with pytest.raises(ActivateError) as err:
        await request_activation(h.conn, "missing")
    assert err.value.code == NOT_FOUND
    await h.seed(*base_objects(scaled_env("e2", min_replicas=1)))
    reply = await request_activation(h.conn, "e2")
    assert not reply.accepted
    assert h.env("e2").effective_replicas == 0


async def test_an_undecodable_request_gets_an_error_reply(h: Harness, served: Activator):
    reply = await h.conn.nc.request(ACTIVATE_SUBJECT, b"\xff\xff\xff", timeout=5)
    assert (reply.headers or {}).get("Nats-Service-Error-Code") == "400"


async def test_concurrent_activations_across_replicas_write_once(conn: Connection, h: Harness, clock: FakeClock):
    # Two activator replicas with their own views; many proxies ask at the same moment.
    await h.seed(*base_objects(scaled_env("e1", scale_to_zero=True, min_replicas=1, max_replicas=5)))
    replicas = []
    for name in ("a", "b"):
        v = StateView(conn, name=name)
        await v.start()
        replicas.append((v, Activator(conn=conn, view=v, writer=Writer(conn, v), clock=clock)))
    seq_before = (await conn.js.stream_info("KV_zattera-state")).state.last_seq
    try:
        replies = await asyncio.gather(*(act.activate("e1", f"n{i}") for i, (_, act) in enumerate(replicas * 10)))
        assert all(r.accepted for r in replies)
        assert sum(act.wakes for _, act in replicas) == 1
        seq_after = (await conn.js.stream_info("KV_zattera-state")).state.last_seq
        assert seq_after - seq_before == 1
    finally:
        for v, _ in replicas:
            await v.stop()


async def test_an_operator_edit_racing_the_wake_is_kept_and_the_wake_redecided(h: Harness):
    await h.seed(*base_objects(scaled_env("e1", scale_to_zero=True, min_replicas=1, max_replicas=5)))
    edited = scaled_env("e1", scale_to_zero=True, min_replicas=3, max_replicas=5)
    writer = InterleavingWriter(h.conn, h.view, before_commit=lambda: h.edit_env(edited))
    activator = Activator(conn=h.conn, view=h.view, writer=writer, clock=h.clock)
    assert (await activator.activate("e1")).accepted
    env = h.env("e1")
    assert env.service.replicas.min == 3  # the operator's edit survived
    assert env.effective_replicas == 3  # woken to the target of the env as edited
