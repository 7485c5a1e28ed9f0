"""``zattera ps`` says how each replica takes part in traffic: serving, draining (until when), green, stopping."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared.clock import to_timestamp
from shared.deployments import replica_role
from tests import factories
from tests.memory_state import MemoryState

DRAIN_DEADLINE = 1_800_000_000  # 2027-01-15 08:00:00 UTC


def deployment(dep_id: str, release_id: str, previous: str, phase: int) -> pb.Deployment:
    d = pb.Deployment(environment_id="e1", release_id=release_id, previous_release_id=previous, phase=phase)  # type: ignore[arg-type]
    d.meta.id = dep_id
    return d


def test_each_replica_says_whether_it_serves_drains_waits_or_stops() -> None:
    promoted = deployment("d1", "r2", "r1", pb.DEPLOYMENT_PHASE_DRAINING_OLD)
    promoted.drain_deadline.CopyFrom(to_timestamp(DRAIN_DEADLINE))
    blue = factories.assignment("n1", "e1", "r1", assignment_id="blue")
    serving = factories.assignment("n1", "e1", "r2", assignment_id="serving")
    stopping = factories.assignment("n1", "e1", "r0", assignment_id="stopping", desired=pb.ASSIGNMENT_DESIRED_STOP)
    moving = factories.assignment("n2", "e1", "r2", assignment_id="moving")
    state = MemoryState(
        factories.env("e1", active_release_id="r2"),
        factories.node("n1"),
        factories.node("n2", status=pb.NODE_STATUS_DRAINING),
        promoted,
        blue,
        serving,
        stopping,
        moving,
    )
    state.observe("n1", "stopping", pb.AssignmentObserved(state=pb.INSTANCE_STATE_RUNNING))
    view = state.store
    roles = {a.meta.id: replica_role(view, a) for a in view.assignments("e1")}
    assert roles == {
        "blue": "draining until 08:00:00 UTC",
        "serving": "serving",
        "stopping": "stopping",
        "moving": "serving (node draining)",
    }
    # A new deploy under way: its replicas are green until the switch; the promoted one's blue set is no
    # longer held once a deployment that is not draining owns the env.
    state.put(deployment("d2", "r3", "r2", pb.DEPLOYMENT_PHASE_STARTING))
    green = factories.assignment("n1", "e1", "r3", assignment_id="green")
    state.put(green)
    assert replica_role(state.store, green) == "green"
