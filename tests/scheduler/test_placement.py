"""Place: pure table tests over a fed view."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared.placement.placement import PlacementIndex, place
from shared.placement.platforms import PlatformError, local_platform, normalize_platform, supports
from tests.factories import assignment, node
from tests.memory_state import MemoryState
from tests.scheduler.builders import pnode, spec_env, spec_release, volume
from tests.scheduler.reference import reference_place

REL = spec_release("rel1", "env1")


def cluster(*nodes: pb.Node, release: pb.Release = REL, extra: tuple[object, ...] = ()) -> MemoryState:
    state = MemoryState(*nodes, release, spec_env("env1", release, project_id="p1"))
    state.put(*extra)  # type: ignore[arg-type]
    return state


# ---------------------------------------------------------------- §4.1 placement_test.go


def test_constraints_filter_keeps_only_matching_nodes():
    rel = spec_release("rel1", "env1", constraints={"region": "eu"})
    state = cluster(pnode("n1", "eu"), pnode("n2", "us"), release=rel)
    assert place(state.store, rel, "env1", 1) == (["n1"], None)


def test_down_and_unschedulable_nodes_are_excluded():
    state = cluster(pnode("n1", status=pb.NODE_STATUS_DOWN), pnode("n2", schedulable=False), pnode("n3"), release=REL)
    assert place(state.store, REL, "env1", 1) == (["n3"], None)


def test_excluded_node_is_skipped():
    state = cluster(pnode("n1"), pnode("n2"))
    assert place(state.store, REL, "env1", 1, exclude={"n1"}) == (["n2"], None)


def test_spread_puts_one_replica_per_node():
    state = cluster(pnode("n1", mem=4096), pnode("n2", mem=4096), pnode("n3", mem=4096))
    assert place(state.store, REL, "env1", 3) == (["n1", "n2", "n3"], None)


def test_capacity_exhaustion_returns_partial_picks_and_an_error():
    rel = spec_release("rel1", "env1", mem=256)
    picks, err = place(cluster(pnode("n1", mem=512), release=rel).store, rel, "env1", 3)
    assert picks == ["n1", "n1"]
    assert str(err) == "placement: only 2 of 3 replicas placeable for env env1 (constraints/capacity)"


def test_existing_run_reservations_of_other_envs_count():
    rel = spec_release("rel1", "env1", mem=256)
    rel_x = spec_release("relX", "envX", mem=256)
    state = cluster(pnode("n1", mem=512), release=rel, extra=(rel_x, assignment("n1", "envX", "relX")))
    picks, err = place(state.store, rel, "env1", 2)
    assert picks == ["n1"] and err is not None


def test_stateful_release_is_pinned_to_its_volume_node():
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data",))
    nodes = (pnode("n1", mem=4096), pnode("n2", mem=4096), pnode("n3", mem=4096))
    state = cluster(*nodes, release=rel, extra=(volume("vol1", "env1", "data", "n2"),))
    assert place(state.store, rel, "env1", 1) == (["n2"], None)


def test_placement_is_deterministic_whatever_the_insertion_order():
    state = cluster(pnode("n3", mem=4096), pnode("n1", mem=4096), pnode("n2", mem=4096))
    first = place(state.store, REL, "env1", 2)
    assert first == place(state.store, REL, "env1", 2) == (["n1", "n2"], None)


def test_unsatisfiable_constraint_names_the_constraint():
    rel = spec_release("rel1", "env1", constraints={"region": "moon"})
    picks, err = place(cluster(pnode("n1", "eu"), pnode("n2", "us"), release=rel).store, rel, "env1", 1)
    assert picks == []
    assert str(err) == "placement: no node matches constraints region=moon for env env1"


def test_matching_but_full_node_is_a_shortfall_not_a_constraint_error():
    rel = spec_release("rel1", "env1", cpu=4000, mem=4096, constraints={"region": "eu"})
    picks, err = place(cluster(pnode("n1", "eu", cpu=1, mem=1), release=rel).store, rel, "env1", 1)
    assert picks == [] and "no node matches" not in str(err) and "only 0 of 1" in str(err)


# ---------------------------------------------------------------- §4.2 archplacement_test.go


def _mixed() -> tuple[pb.Node, pb.Node]:
    return (
        pnode("amd1", cpu=4000, mem=8192, os_arch="linux/amd64"),
        pnode("arm1", cpu=4000, mem=8192, os_arch="linux/arm64"),
    )


@pytest.mark.parametrize(
    ("platforms", "n", "expected"),
    [
        (("linux/amd64",), 1, ["amd1"]),
        (("linux/arm64",), 1, ["arm1"]),
        (("linux/amd64", "linux/arm64"), 2, ["amd1", "arm1"]),
        ((), 2, ["amd1", "arm1"]),
    ],
    ids=["amd64-only", "arm64-only", "multi-arch", "empty-platforms-is-unconstrained"],
)
def test_release_platforms_select_matching_nodes(platforms, n, expected):
    rel = spec_release("rel1", "env1", platforms=platforms)
    picks, err = place(cluster(*_mixed(), release=rel).store, rel, "env1", n)
    assert sorted(picks) == expected and err is None


def test_legacy_node_without_arch_takes_an_unconstrained_release():
    state = cluster(pnode("legacy", cpu=4000, mem=8192, os_arch=""))
    assert place(state.store, REL, "env1", 1) == (["legacy"], None)


def test_no_supported_architecture_names_the_needed_platforms():
    rel = spec_release("rel1", "env1", platforms=("linux/amd64",))
    picks, err = place(cluster(_mixed()[1], release=rel).store, rel, "env1", 1)
    assert picks == []
    assert str(err) == "placement: no node with a supported architecture (need one of linux/amd64) for env env1"


def test_stateful_pin_to_wrong_arch_node_reports_the_arch_error_as_the_reference():
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data",), platforms=("linux/amd64",))
    state = cluster(*_mixed(), release=rel, extra=(volume("v1", "env1", "data", "arm1"),))
    picks, err = place(state.store, rel, "env1", 1)
    assert picks == [] and "supported architecture" in str(err)


def test_platform_alias_in_release_matches_node():
    rel = spec_release("rel1", "env1", platforms=("linux/aarch64",))
    assert place(cluster(_mixed()[1], release=rel).store, rel, "env1", 1) == (["arm1"], None)


# ---------------------------------------------------------------- §4.3 platform_test.go


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("linux/amd64", "linux/amd64"),
        ("Linux/AMD64", "linux/amd64"),
        (" linux/arm64 ", "linux/arm64"),
        ("linux/x86_64", "linux/amd64"),
        ("linux/x86-64", "linux/amd64"),
        ("linux/aarch64", "linux/arm64"),
        ("linux/arm64/v8", "linux/arm64"),
        ("linux/arm/v7", "linux/arm"),
        ("darwin/arm64", "darwin/arm64"),
        ("linux/riscv64", "linux/riscv64"),
    ],
)
def test_normalize_accepts_aliases_and_case(text, expected):
    assert normalize_platform(text) == expected


@pytest.mark.parametrize("text", ["linux", "", "linux/", "/amd64", "plan9/amd64", "linux/sparc"])
def test_normalize_rejects_malformed_or_unknown(text):
    with pytest.raises(PlatformError):
        normalize_platform(text)


def test_normalize_error_shows_an_example_pair():
    with pytest.raises(PlatformError, match="linux/amd64"):
        normalize_platform("bogus")


def test_local_platform_normalizes():
    assert normalize_platform(local_platform()) == local_platform()


@pytest.mark.parametrize(
    ("node_arch", "platforms", "expected"),
    [
        ("", [], True),
        ("linux/arm64", [], True),
        ("linux/amd64", ["linux/amd64"], True),
        ("linux/arm64", ["linux/amd64"], False),
        ("linux/arm64", ["linux/amd64", "linux/arm64"], True),
        ("linux/amd64", ["linux/x86_64"], True),
        ("linux/aarch64", ["linux/arm64"], True),
        ("linux/amd64", ["Linux/AMD64"], True),
        ("", ["linux/amd64"], False),
    ],
)
def test_supports_matches_loosely_on_both_sides(node_arch, platforms, expected):
    assert supports(node_arch, platforms) is expected


# ---------------------------------------------------------------- derived cases 43–49


def test_spread_prefers_least_loaded_region():
    state = cluster(pnode("a", "eu"), pnode("b", "eu"), pnode("c", "us"))
    assert place(state.store, REL, "env1", 2) == (["a", "c"], None)


def test_most_free_memory_wins_and_unreported_capacity_wins_outright():
    state = cluster(pnode("n1", mem=2048), pnode("n2", mem=4096))
    assert place(state.store, REL, "env1", 1) == (["n2"], None)
    state.put(pnode("n0", cpu=0, mem=0))
    assert place(state.store, REL, "env1", 1) == (["n0"], None)


def test_zero_capacity_is_unlimited():
    rel = spec_release("rel1", "env1", cpu=4000, mem=64000)
    assert place(cluster(pnode("n1", cpu=0, mem=0), release=rel).store, rel, "env1", 5) == (["n1"] * 5, None)


def test_cpu_alone_can_exhaust_a_node():
    picks, err = place(cluster(pnode("n1", cpu=250, mem=0)).store, REL, "env1", 3)
    assert picks == ["n1", "n1"] and "only 2 of 3" in str(err)


def test_arch_error_takes_precedence_over_label_error():
    rel = spec_release("rel1", "env1", platforms=("linux/amd64",), constraints={"region": "eu"})
    nodes = (pnode("n1", "eu", os_arch="linux/arm64"), pnode("n2", "us", os_arch="linux/amd64"))
    picks, err = place(cluster(*nodes, release=rel).store, rel, "env1", 1)
    assert picks == [] and "supported architecture" in str(err)


def test_pin_to_down_node_is_a_plain_shortfall():
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data",))
    nodes = (pnode("n1", status=pb.NODE_STATUS_DOWN), pnode("n2"))
    picks, err = place(cluster(*nodes, release=rel, extra=(volume("v1", "env1", "data", "n1"),)).store, rel, "env1", 1)
    assert picks == []
    assert str(err) == "placement: only 0 of 1 replicas placeable for env env1 (constraints/capacity)"


@pytest.mark.parametrize("n", [0, -1])
def test_non_positive_n_places_nothing_without_error_even_on_an_empty_cluster(n):
    assert place(MemoryState().store, REL, "env1", n) == ([], None)


def test_replicas_on_down_nodes_still_weigh_in_the_spread():
    state = cluster(pnode("n1", "eu"), pnode("n2", "us"), pnode("n3", "eu", status=pb.NODE_STATUS_DOWN))
    state.put(assignment("n3", "env1", "rel1"))
    assert place(state.store, REL, "env1", 1) == (["n2"], None)


# ---------------------------------------------------------------- this project's fixes


def test_control_only_node_gets_no_replicas_fix_roles():
    control = pnode("c1", cpu=0, mem=0, roles=(pb.NODE_ROLE_CONTROL,))
    state = cluster(control, pnode("w1"))
    assert place(state.store, REL, "env1", 2) == (["w1", "w1"], None)
    only_control = cluster(control)
    assert place(only_control.store, REL, "env1", 1)[0] == []


def test_split_volume_pins_give_a_clear_error_fix_first_pin_silently_won():
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data", "logs"))
    pins = (volume("v1", "env1", "data", "n1"), volume("v2", "env1", "logs", "n2"))
    picks, err = place(cluster(pnode("n1"), pnode("n2"), release=rel, extra=pins).store, rel, "env1", 1)
    assert picks == []
    assert str(err) == (
        'placement: volumes of env env1 are pinned to different nodes ("data" on n1, "logs" on n2); '
        "a stateful replica needs all its volumes on one node"
    )


def test_agreeing_volume_pins_place_on_their_node():
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data", "logs"))
    pins = (volume("v1", "env1", "data", "n2"), volume("v2", "env1", "logs", "n2"))
    assert place(cluster(pnode("n1"), pnode("n2"), release=rel, extra=pins).store, rel, "env1", 1) == (["n2"], None)


# ---------------------------------------------------------------- the pass overlay


def test_index_fed_with_a_decision_places_the_next_env_as_if_it_were_written():
    rel_a = spec_release("relA", "envA", mem=512)
    rel_b = spec_release("relB", "envB", mem=512)
    state = MemoryState(pnode("n1", mem=1024), pnode("n2", mem=1024), rel_a, rel_b)
    state.put(spec_env("envA", rel_a), spec_env("envB", rel_b))
    index = PlacementIndex(state.store)
    picks_a, _ = index.place(rel_a, "envA", 3)
    for node_id in picks_a:
        index.reserve(node_id, "envA", 100, 512)
    picks_b, err_b = index.place(rel_b, "envB", 2)
    state.put(*(assignment(n, "envA", "relA") for n in picks_a))
    ref_picks, ref_err = reference_place(state.store, rel_b, "envB", 2)
    assert picks_b == ref_picks and str(err_b) == str(ref_err)
    assert picks_a == ["n1", "n2", "n1"] and picks_b == ["n2"]


def test_default_reservation_applies_per_dimension():
    rel = spec_release("rel1", "env1", mem=64)
    picks, _ = place(cluster(pnode("n1", cpu=250, mem=0), release=rel).store, rel, "env1", 5)
    assert picks == ["n1", "n1"]


def test_role_filter_applies_before_the_arch_flag():
    control = node("c1", os_arch="linux/arm64", roles=(pb.NODE_ROLE_CONTROL,))
    rel = spec_release("rel1", "env1", platforms=("linux/amd64",))
    picks, err = place(cluster(control, release=rel).store, rel, "env1", 1)
    assert picks == [] and "only 0 of 1" in str(err)
