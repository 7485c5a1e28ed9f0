"""The agent simulator reports what an agent would, on the agent's own keys."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent_sim import AgentSim
from tests.orchestrator.rig import copied, replica
from tests.waiting import eventually


def state_of(view: StateView, assignment_id: str) -> int:
    a = view.assignment(assignment_id)
    return a.observed.state if a is not None else -1


async def test_reports_follow_the_gates_stopped_for_stop_and_nothing_for_dead_nodes(
    conn: Connection, view: StateView, writer: Writer
) -> None:
    agent = await AgentSim(conn).start()
    try:
        agent.green_state = pb.INSTANCE_STATE_RUNNING
        agent.dead_nodes.add("n3")
        await writer.commit(
            writer.txn()
            .put(replica("plain", "n1", "e", "r"))
            .put(replica("green", "n2", "e", "r", deployment_id="d1"))
            .put(replica("ghost", "n3", "e", "r"))
        )
        await eventually(lambda: state_of(view, "plain") == pb.INSTANCE_STATE_HEALTHY)
        await eventually(lambda: state_of(view, "green") == pb.INSTANCE_STATE_RUNNING)
        assert view.observed("n3", "ghost") is None
        stop = copied(view.assignment("plain"))
        assert stop is not None
        stop.desired = pb.ASSIGNMENT_DESIRED_STOP
        await writer.commit(writer.txn().put(stop))
        await eventually(lambda: state_of(view, "plain") == pb.INSTANCE_STATE_STOPPED)
        agent.overrides["green"] = pb.INSTANCE_STATE_FAILED
        agent.poke()
        await eventually(lambda: state_of(view, "green") == pb.INSTANCE_STATE_FAILED)
        assert K.observed("n2", "green") in {K.observed(n, a) for n, a in view.observed_keys()}
    finally:
        await agent.stop()


async def test_a_restarted_instance_reports_a_new_container(conn: Connection, view: StateView, writer: Writer) -> None:
    agent = await AgentSim(conn).start()
    try:
        a = replica("db", "n1", "e", "r")
        a.desired = pb.ASSIGNMENT_DESIRED_STOP
        await writer.commit(writer.txn().put(a))
        await eventually(lambda: state_of(view, "db") == pb.INSTANCE_STATE_STOPPED)
        first = view.observed("n1", "db")
        assert first is not None
        restart = copied(view.assignment("db"))
        assert restart is not None
        restart.desired = pb.ASSIGNMENT_DESIRED_RUN
        await writer.commit(writer.txn().put(restart))
        await eventually(lambda: state_of(view, "db") == pb.INSTANCE_STATE_HEALTHY)
        second = view.observed("n1", "db")
        assert second is not None and second.container_id != first.container_id
    finally:
        await agent.stop()
