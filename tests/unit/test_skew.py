"""Version skew as pure decisions (shared/skew.py): what may run against a cluster recorded at a version and
schema, and what a proxy or ``zattera nodes list`` says about a peer's version."""

from __future__ import annotations

import pytest

from shared.skew import Component, Verdict, judge, judge_peer, lines_behind, node_version_note

CP, AGENT, PROXY, CLI = Component.CONTROL_PLANE, Component.AGENT, Component.PROXY, Component.CLI


@pytest.mark.parametrize(
    ("component", "version", "schema", "cluster_version", "cluster_schema", "verdict"),
    [
        # The control plane upgrades an older cluster, runs on its own schema, refuses a newer one.
        (CP, "0.2.0", 1, "", 0, Verdict.UPGRADE),  # a 0.1.0 cluster (nothing recorded)
        (CP, "0.2.0", 1, "0.2.0", 1, Verdict.OK),
        (CP, "0.2.1", 1, "0.2.0", 1, Verdict.OK),  # a patch moves nothing but the recorded version
        (CP, "0.2.0", 1, "0.3.0", 3, Verdict.DOWNGRADE),
        (CP, "0.2.0", 1, "0.3.0", 1, Verdict.BEHIND),  # 0.3 added no migration: the rolling upgrade's old side
        (CP, "0.4.0", 5, "0.2.0", 1, Verdict.UPGRADE),  # a stopped cluster may skip releases
        (CP, "0.2.0", 3, "0.4.0", 3, Verdict.TOO_OLD),
        # Agents: one release line behind at most; ahead of the cluster's schema, they wait.
        (AGENT, "0.2.0", 1, "", 0, Verdict.WAIT),
        (AGENT, "0.2.0", 1, "0.2.0", 1, Verdict.OK),
        (AGENT, "0.2.0", 1, "0.3.0", 2, Verdict.BEHIND),
        (AGENT, "0.2.0", 1, "0.4.0", 4, Verdict.TOO_OLD),
        (AGENT, "0.3.0", 1, "0.2.0", 1, Verdict.OK),  # newer, but needs nothing the cluster lacks
        (AGENT, "1.0.0", 9, "0.9.0", 9, Verdict.TOO_OLD),  # another major is never mixed
        (AGENT, "dev", 1, "0.2.0", 1, Verdict.TOO_OLD),
        (CLI, "0.2.0", 1, "0.1.0", 0, Verdict.WAIT),
        (CLI, "0.2.0", 1, "0.3.0", 2, Verdict.BEHIND),
    ],
)
def test_what_may_run_against_a_cluster(
    component: Component, version: str, schema: int, cluster_version: str, cluster_schema: int, verdict: Verdict
) -> None:
    skew = judge(component, version, schema, cluster_version, cluster_schema)
    assert skew.verdict is verdict, skew.message
    assert skew.refused == (verdict in (Verdict.TOO_OLD, Verdict.DOWNGRADE))
    assert (skew.message == "") == (verdict is Verdict.OK)
    assert "\n" not in skew.message


def test_the_refusals_say_what_to_run() -> None:
    downgrade = judge(CP, "0.2.0", 1, "0.3.0", 3)
    assert downgrade.message == (
        "the cluster (Zattera 0.3.0, schema 3) is newer than this control plane (Zattera 0.2.0, schema 1): "
        "downgrades are refused; run Zattera 0.3.0 or newer (docs/upgrades.md)"
    )
    old = judge(AGENT, "0.2.0", 1, "0.4.0", 4)
    assert old.message == (
        "this agent (Zattera 0.2.0) is too old for the cluster (Zattera 0.4.0, schema 4), which accepts 0.3 or "
        "newer: upgrade it (docs/upgrades.md)"
    )
    assert "upgrade the control plane first" in judge(AGENT, "0.2.0", 1, "", 0).message


@pytest.mark.parametrize(
    ("version", "control", "verdict"),
    [
        ("0.2.0", "0.2.0", Verdict.OK),
        ("0.2.0", "", Verdict.OK),  # routes made before they carried a version
        ("0.2.0", "0.3.0", Verdict.BEHIND),
        ("0.2.0", "0.4.0", Verdict.TOO_OLD),
        ("0.3.0", "0.2.0", Verdict.WAIT),
    ],
)
def test_what_a_proxy_says_of_its_control_plane(version: str, control: str, verdict: Verdict) -> None:
    assert judge_peer(PROXY, version, control).verdict is verdict


@pytest.mark.parametrize(
    ("version", "cluster", "note"),
    [
        ("0.2.0", "0.2.0", ""),
        ("0.1.0", "0.2.0", "behind"),
        ("0.1.0", "", ""),  # a 0.1.0 cluster records no version
        ("0.1.0", "0.3.0", "too old"),
        ("0.3.0", "0.2.0", "newer"),
        ("", "0.2.0", "unknown"),
    ],
)
def test_what_nodes_list_says_beside_a_version(version: str, cluster: str, note: str) -> None:
    assert node_version_note(version, cluster) == note


def test_lines_are_counted_in_minor_releases() -> None:
    assert lines_behind("0.2.7", "0.3.0") == 1
    assert lines_behind("0.3.0", "0.2.5") == -1
    assert lines_behind("1.0.0", "0.9.0") is None
