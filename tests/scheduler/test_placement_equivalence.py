"""The fast Place equals the literal reference algorithm (tests/scheduler/reference.py) on random clusters,
for single calls and for a sequence of envs placed through one index (the scheduler's pass)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zattera.v1 import types_pb2 as pb

from shared.placement.placement import PlacementIndex, place
from shared.state.tables import reservation
from tests.factories import assignment, node
from tests.memory_state import MemoryState
from tests.scheduler.builders import spec_env, spec_release, volume
from tests.scheduler.reference import reference_place

REGIONS = ["", "eu", "us", "ap"]
ARCHES = ["linux/amd64", "linux/arm64", "", "Linux/x86_64"]
ENVS = ["e1", "e2", "e3"]


@st.composite
def nodes(draw: st.DrawFn) -> list[pb.Node]:
    count = draw(st.integers(0, 10))
    result = []
    for i in range(count):
        labels = draw(st.sampled_from([{}, {"disk": "ssd"}, {"disk": "hdd"}]))
        result.append(
            node(
                f"n{i:02d}",
                cpu=draw(st.sampled_from([0, 250, 1000, 2000])),
                mem=draw(st.sampled_from([0, 300, 512, 1024, 4096])),
                region=draw(st.sampled_from(REGIONS)),
                status=draw(
                    st.sampled_from([pb.NODE_STATUS_ALIVE] * 4 + [pb.NODE_STATUS_DOWN, pb.NODE_STATUS_DRAINING])
                ),
                schedulable=draw(st.booleans() | st.just(True)),
                os_arch=draw(st.sampled_from(ARCHES)),
                labels=labels,
                roles=draw(st.sampled_from([(pb.NODE_ROLE_WORKER,)] * 4 + [(pb.NODE_ROLE_CONTROL,), ()])),
            )
        )
    return result


@st.composite
def releases(draw: st.DrawFn, env_id: str) -> pb.Release:
    volumes = draw(st.sampled_from([(), ("data",), ("data", "logs")]))
    return spec_release(
        f"r-{env_id}",
        env_id,
        cpu=draw(st.sampled_from([0, 100, 300])),
        mem=draw(st.sampled_from([0, 128, 256, 512])),
        stateful=bool(volumes),
        volumes=volumes,
        platforms=draw(st.sampled_from([(), ("linux/amd64",), ("linux/arm64", "linux/amd64"), ("linux/aarch64",)])),
        constraints=draw(st.sampled_from([{}, {"disk": "ssd"}, {"disk": ""}, {"region": "eu"}])),
    )


@st.composite
def clusters(draw: st.DrawFn) -> tuple[MemoryState, dict[str, pb.Release]]:
    node_list = draw(nodes())
    node_ids = [n.meta.id for n in node_list] + ["ghost"]
    rels = {env_id: draw(releases(env_id)) for env_id in ENVS}
    state = MemoryState(*node_list, *rels.values())
    state.put(*(spec_env(env_id, rel, project_id="p1") for env_id, rel in rels.items()))
    for i in range(draw(st.integers(0, 12))):
        env_id = draw(st.sampled_from([*ENVS, "other"]))
        release_id = draw(st.sampled_from([f"r-{env_id}", "gone"]))
        desired = draw(st.sampled_from([pb.ASSIGNMENT_DESIRED_RUN] * 3 + [pb.ASSIGNMENT_DESIRED_STOP]))
        a = assignment(draw(st.sampled_from(node_ids)), env_id, release_id, assignment_id=f"a{i:02d}", desired=desired)
        state.put(a)
    for env_id in ENVS:
        for name in ("data", "logs"):
            if draw(st.booleans()):
                state.put(volume(f"v-{env_id}-{name}", env_id, name, draw(st.sampled_from(node_ids))))
    return state, rels


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.sampled_from(ENVS), st.integers(0, 9), st.sets(st.sampled_from(["n00", "n01", "n03", "x"])))
def test_place_equals_the_reference_algorithm(cluster, env_id, n, exclude):
    state, rels = cluster
    fast = place(state.store, rels[env_id], env_id, n, exclude)
    slow = reference_place(state.store, rels[env_id], env_id, n, exclude)
    assert (fast[0], str(fast[1])) == (slow[0], str(slow[1]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.lists(st.tuples(st.sampled_from(ENVS), st.integers(1, 6)), min_size=1, max_size=5))
def test_sequential_placement_through_one_index_equals_the_reference_with_writes_applied(cluster, calls):
    state, rels = cluster
    index = PlacementIndex(state.store)
    fast_results = []
    for env_id, n in calls:
        picks, err = index.place(rels[env_id], env_id, n)
        fast_results.append((picks, str(err)))
        cpu, mem = reservation(rels[env_id])
        for node_id in picks:
            index.reserve(node_id, env_id, cpu, mem)
    # The same sequence against the literal algorithm, writing each call's picks before the next.
    slow_results = []
    for k, (env_id, n) in enumerate(calls):
        picks, err = reference_place(state.store, rels[env_id], env_id, n)
        slow_results.append((picks, str(err)))
        state.put(*(assignment(nid, env_id, f"r-{env_id}", assignment_id=f"z{k}-{i}") for i, nid in enumerate(picks)))
    assert fast_results == slow_results
