"""An operator's node changes (shared/actions/nodes.py): the record each one writes, as a table; committed on
real NATS, announced with the actor, and a change with nothing to do writes and announces nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.aio.msg import Msg
from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext
from shared.actions.nodes import EditNode, NodeChange, RemoveNode, change_node, edit_node, remove_node
from shared.actions.refusals import Conflicting, NotFound, Unavailable
from shared.connection import Connection
from shared.txn import Writer
from tests import factories
from tests.actions.conftest import ACTOR
from tests.eventlog import stored_events, wait_for_kinds
from tests.waiting import eventually

ALIVE, DOWN = pb.NODE_STATUS_ALIVE, pb.NODE_STATUS_DOWN
DRAINING, DRAINED = pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED


def node(status: int, schedulable: bool, **labels: str) -> pb.Node:
    found = pb.Node(name="n1", status=status, schedulable=schedulable, labels=labels)
    found.meta.id = "n1"
    return found


@pytest.mark.parametrize(
    ("status", "schedulable", "change", "after"),
    [
        # (status, schedulable) before → after; None: nothing to write
        (ALIVE, True, NodeChange.CORDON, (ALIVE, False)),
        (ALIVE, False, NodeChange.CORDON, (ALIVE, False)),  # written again: harmless, and announces nothing
        (DOWN, True, NodeChange.CORDON, (DOWN, False)),
        (DRAINING, False, NodeChange.CORDON, None),  # unschedulable already
        (DRAINED, False, NodeChange.CORDON, None),
        (ALIVE, False, NodeChange.UNCORDON, (ALIVE, True)),
        (DRAINING, False, NodeChange.UNCORDON, (ALIVE, True)),  # ends the drain
        (DRAINED, False, NodeChange.UNCORDON, (ALIVE, True)),
        (ALIVE, True, NodeChange.DRAIN, (DRAINING, False)),
        (DOWN, True, NodeChange.DRAIN, (DRAINING, False)),
        (DRAINED, False, NodeChange.DRAIN, (DRAINING, False)),  # again: the scheduler re-checks it is empty
        (ALIVE, True, NodeChange.LABEL, (ALIVE, True)),
        (DOWN, False, NodeChange.LABEL, (DOWN, False)),
    ],
)
def test_each_change_writes(status: int, schedulable: bool, change: NodeChange, after: tuple[int, bool] | None) -> None:
    before = node(status, schedulable)
    edited = change_node(before, change)
    written = (edited.status, edited.schedulable) if edited else None
    assert written == after
    assert (before.status, before.schedulable) == (status, schedulable), "the view's record is never mutated"


def test_uncordon_of_a_down_node_is_refused_naming_it() -> None:
    with pytest.raises(Conflicting, match="node n1 is down: it cannot be uncordoned until it heartbeats"):
        change_node(node(DOWN, False), NodeChange.UNCORDON)


@pytest.mark.parametrize(
    ("given", "after"),
    [
        ({"zone": "b"}, {"zone": "b", "disk": "ssd"}),  # set
        ({"gpu": "yes"}, {"zone": "a", "disk": "ssd", "gpu": "yes"}),  # add
        ({"zone": ""}, {"disk": "ssd"}),  # key= removes
        ({"absent": ""}, {"zone": "a", "disk": "ssd"}),  # removing an absent key is no error
        ({}, {"zone": "a", "disk": "ssd"}),
    ],
)
def test_labels_set_and_remove(given: dict[str, str], after: dict[str, str]) -> None:
    edited = change_node(node(ALIVE, True, zone="a", disk="ssd"), NodeChange.LABEL, given)
    assert edited is not None and dict(edited.labels) == after


def test_the_change_names_are_the_commands() -> None:
    assert [str(c) for c in NodeChange] == ["cordon", "uncordon", "drain", "label"]


async def test_edit_node_commits_and_announces_a_status_change_with_the_actor(
    ctx: ActionContext, conn: Connection, writer: Writer
) -> None:
    await writer.commit(writer.txn().create(factories.node("n1")))
    done = await edit_node(ctx, EditNode("n1", NodeChange.DRAIN))
    assert (done.written, done.status) == (True, "DRAINING")
    [event] = [e for e in await wait_for_kinds(conn, "node.draining") if e.kind == "node.draining"]
    assert (event.node_id, event.fields["actor"], event.fields["from"], event.fields["to"]) == (
        "n1",
        ACTOR,
        "ALIVE",
        "DRAINING",
    )
    again = await edit_node(ctx, EditNode("n1", NodeChange.CORDON))  # a draining node takes no replicas already
    assert (again.written, again.status) == (False, "DRAINING")
    labeled = await edit_node(ctx, EditNode("n1", NodeChange.LABEL, {"zone": "b"}))
    node_now = ctx.view.node("n1")
    assert labeled.written and node_now is not None and dict(node_now.labels) == {"zone": "b"}
    assert [e.kind for e in await stored_events(conn)] == ["node.draining"], "labels and no-ops announce nothing"


async def test_edit_node_of_an_unknown_node_is_not_found(ctx: ActionContext) -> None:
    with pytest.raises(NotFound, match=r"^node 'n9' not found$"):
        await edit_node(ctx, EditNode("n9", NodeChange.CORDON))


async def test_remove_node_asks_the_join_service_and_reports_its_answer(ctx: ActionContext, conn: Connection) -> None:
    from shared.security.permissions import JOIN_REMOVE_SUBJECT

    with pytest.raises(Unavailable, match="no join service answered"):
        await remove_node(ctx, RemoveNode("w1", timeout=1.0))

    async def answer(msg: Msg) -> None:
        node_id = json.loads(msg.data)["node_id"]
        reply = {"error": f"{node_id} is not drained"} if node_id == "busy" else {"revoked": ["UA1", "UA2"]}
        await msg.respond(json.dumps({"node_id": node_id, "peer_removed": True, **reply}).encode())

    sub = await conn.nc.subscribe(JOIN_REMOVE_SUBJECT, cb=answer)
    try:
        done = await remove_node(ctx, RemoveNode("w1"))
        assert (done.node_id, done.revoked, done.peer_removed) == ("w1", ["UA1", "UA2"], True)
        with pytest.raises(Conflicting, match=r"^busy is not drained$"):
            await remove_node(ctx, RemoveNode("busy"))
    finally:
        await sub.unsubscribe()


async def test_remove_node_drains_the_node_first_and_waits_until_it_is_drained(
    ctx: ActionContext, conn: Connection, writer: Writer
) -> None:
    """The scheduler's part (DRAINING → DRAINED once its replicas moved) is played here; the join service's
    answer is asked only once the node is DRAINED, and its report (servers, streams short) comes back."""
    from shared.security.permissions import JOIN_REMOVE_SUBJECT

    await writer.commit(writer.txn().create(factories.node("m4")))
    asked: list[int] = []

    async def answer(msg: Msg) -> None:
        found = ctx.view.node("m4")
        asked.append(found.status if found is not None else -1)
        short = [{"stream": "KV_zattera-live", "replicas": 3, "current": 2, "servers": ["m1", "m2"]}]
        reply = {"node_id": "m4", "peer_removed": True, "servers": ["m4"], "revoked": ["UA1"], "short": short}
        await msg.respond(json.dumps(reply).encode())

    sub = await conn.nc.subscribe(JOIN_REMOVE_SUBJECT, cb=answer)
    try:
        removal = asyncio.create_task(remove_node(ctx, RemoveNode("m4")))
        await eventually(lambda: (n := ctx.view.node("m4")) is not None and n.status == DRAINING)
        assert not asked and not removal.done(), "nothing removed while the node drains"
        await writer.commit(writer.txn().put(_with_status(ctx, "m4", DRAINED)))
        done = await asyncio.wait_for(removal, 10)
        assert asked == [DRAINED]
        assert (done.drained, done.servers, done.revoked) == (True, ["m4"], ["UA1"])
        assert [(s.stream, s.current, s.replicas) for s in done.short] == [("KV_zattera-live", 2, 3)]

        with pytest.raises(Conflicting, match=r"^node m4 is not drained after 0 s \(0 replica\(s\) still placed"):
            await writer.commit(writer.txn().put(_with_status(ctx, "m4", ALIVE)))
            await remove_node(ctx, RemoveNode("m4", drain_timeout=0.0))
    finally:
        await sub.unsubscribe()


def _with_status(ctx: ActionContext, node_id: str, status: int) -> pb.Node:
    found = ctx.view.node(node_id)
    assert found is not None
    edited = pb.Node()
    edited.CopyFrom(found)
    edited.status = status  # type: ignore[assignment]
    return edited
