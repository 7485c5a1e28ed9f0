"""Placement explains itself: each node counted under the first named filter it fails (pure, over a view)."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared.placement.explain import Explanation, explain
from shared.placement.placement import FILTERS, place
from tests.factories import assignment
from tests.memory_state import MemoryState
from tests.scheduler.builders import pnode, spec_env, spec_release


def state_of(release: pb.Release, *objects: object) -> MemoryState:
    state = MemoryState(release, spec_env("env1", release, project_id="p1"))
    state.put(*objects)  # type: ignore[arg-type]
    return state


def test_every_node_is_counted_under_the_first_filter_it_fails() -> None:
    rel = spec_release("rel1", "env1", mem=512, platforms=("linux/arm64",), constraints={"disk": "ssd"})
    other = spec_release("relX", "envX", mem=512)
    state = state_of(
        rel,
        other,
        pnode("down", status=pb.NODE_STATUS_DOWN, os_arch="linux/amd64"),  # down beats the wrong arch
        pnode("cordoned", schedulable=False),
        pnode("control", roles=(pb.NODE_ROLE_CONTROL,)),
        pnode("amd1", os_arch="linux/amd64", labels={"disk": "ssd"}),
        pnode("amd2", os_arch="linux/amd64"),
        pnode("hdd", os_arch="linux/arm64", labels={"disk": "hdd"}),
        pnode("small", os_arch="linux/arm64", labels={"disk": "ssd"}, mem=256),
        pnode("busy", os_arch="linux/arm64", labels={"disk": "ssd"}, mem=768, cpu=0),  # relX holds 512
        assignment("busy", "envX", "relX"),
        pnode("room", os_arch="linux/arm64", labels={"disk": "ssd"}, mem=4096),
        pnode("mine", os_arch="linux/arm64", labels={"disk": "ssd"}, mem=4096),
    )
    explained = explain(state.store, rel, "env1", exclude={"mine"})
    assert explained == Explanation(
        nodes=10,
        filtered={
            "excluded": 1,
            "not alive": 1,
            "cordoned": 1,
            "control only": 1,
            "arch": 2,
            "labels": 1,
            "memory": 2,
        },
        fit=1,
    )
    assert list(explained.filtered) == [f for f in FILTERS if f in explained.filtered]  # in filter order
    assert explained.summary() == (
        "10 nodes: 1 filtered by excluded, 1 by not alive, 1 by cordoned, 1 by control only, 2 by arch, "
        "1 by labels, 2 by memory, 1 with room"
    )


def test_the_issue_example_and_a_cpu_shortfall() -> None:
    rel = spec_release("rel1", "env1", cpu=500, mem=512, platforms=("linux/arm64",))
    arch = [pnode(f"x{i}", os_arch="linux/amd64") for i in range(3)]
    state = state_of(rel, *arch, pnode("m1", os_arch="linux/arm64", mem=256), pnode("m2", os_arch="linux/arm64", mem=1))
    assert explain(state.store, rel, "env1").summary() == "5 nodes: 3 filtered by arch, 2 by memory"
    cpu_bound = state_of(rel, pnode("c1", os_arch="linux/arm64", cpu=400))
    assert explain(cpu_bound.store, rel, "env1").summary() == "1 node: 1 filtered by cpu"
    assert explain(state_of(rel).store, rel, "env1").summary() == "no nodes registered"


def test_explain_agrees_with_place() -> None:
    """A node explain finds room on is one place can pick; none with room means place fails."""
    rel = spec_release("rel1", "env1", mem=512, constraints={"zone": "a"})
    state = state_of(rel, pnode("n1", labels={"zone": "b"}), pnode("n2", labels={"zone": "a"}, mem=256))
    picks, error = place(state.store, rel, "env1", 1)
    assert picks == [] and error is not None and explain(state.store, rel, "env1").fit == 0
    state.put(pnode("n3", labels={"zone": "a"}, mem=1024))
    picks, error = place(state.store, rel, "env1", 1)
    assert picks == ["n3"] and error is None and explain(state.store, rel, "env1").fit == 1
