"""The one decision output type (shared/decision.py) applied as one batch on a real NATS server."""

from __future__ import annotations

import pytest

from shared.decision import Decision
from shared.state.feed import StateView
from shared.txn import Conflict, Writer
from tests.factories import env, node


async def test_the_fence_goes_last_and_a_change_to_it_refuses_the_whole_decision(
    view: StateView, writer: Writer
) -> None:
    await writer.commit(writer.txn().create(node("n1", cpu=1)).create(env("e1")))
    decision = Decision("step", creates=[node("n2")], deletes=["env.e1"], fence=node("n1", cpu=1))
    assert bool(decision) and len(decision) == 3
    assert Decision("nothing") == Decision("nothing") and not Decision("nothing")
    txn = decision.txn(writer)
    assert txn.keys == ["node.n2", "env.e1", "node.n1"]

    await writer.commit(writer.txn().put(node("n1", cpu=2)))  # someone changed the fence meanwhile
    with pytest.raises(Conflict):
        await writer.commit(txn)
    assert view.node("n2") is None and view.env("e1") is not None

    await writer.commit(decision.txn(writer))  # built again, it expects the revisions now
    assert view.node("n2") is not None and view.env("e1") is None
    assert view.node("n1").capacity.cpu_millis == 1
