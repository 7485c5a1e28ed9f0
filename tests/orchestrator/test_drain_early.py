"""A drain that ends when the work does (issue 42): the old release is stopped before the drain window
ends once every live proxy reports nothing in flight to it — pure decisions over a fed view, fake time."""

from __future__ import annotations

from dataclasses import replace

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, deployment_of
from services.orchestrator.phases import decide
from shared import keys as K
from shared.clock import to_timestamp
from tests.orchestrator.rig import copied
from tests.orchestrator.test_phases import ENV, HEALTHY, T0, TIMERS, Board, place_green, red_green_board

PH = pb.DeploymentPhase
STOP = pb.ASSIGNMENT_DESIRED_STOP
QUIET = TIMERS.drain_quiet
WINDOW = TIMERS.drain_window


def draining_board() -> Board:
    """rel2 promoted at T0 (drain window open until T0 + 600), rel1's two replicas still running."""
    b = red_green_board()
    green = place_green(b)
    b.observe(green, HEALTHY)
    for _ in range(3):
        b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    return b


def env_revision(b: Board) -> int:
    return b.view.rev(K.env(ENV))


def proxy(
    b: Board,
    proxy_id: str,
    at: float,
    *,
    old_inflight: int = 0,
    behind: bool = False,
    counts: bool = True,
) -> cpb.ProxyHeartbeat:
    """A proxy's heartbeat sampled at ``at``: routing by the promotion (or one version ``behind`` it)."""
    hb = cpb.ProxyHeartbeat(proxy_id=proxy_id, time=to_timestamp(at), drain_counts=counts)
    hb.routes_version = env_revision(b) - (1 if behind else 0)
    if old_inflight:
        hb.old_inflight[ENV] = old_inflight
    return hb


def outcome(b: Board, now: float, proxies: list[cpb.ProxyHeartbeat] | None, timers: Timers = TIMERS) -> str:
    """``stop`` (blue stopped, SUCCEEDED in one write) or ``keep`` (nothing written)."""
    t = decide(b.view, b.d(), now, timers, proxies)
    if t is None:
        return "keep"
    assert deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert sorted((a.meta.id, a.desired) for a in t.puts) == [("blue-0", STOP), ("blue-1", STOP)]  # type: ignore[attr-defined]
    return "stop"


AFTER = T0 + QUIET + 2  # both proxies have sampled well after the promotion and the quiet period


@pytest.mark.parametrize(
    ("case", "now", "reports", "expected"),
    [
        ("zero in flight everywhere", AFTER, [("p1", AFTER, 0), ("p2", AFTER - 1, 0)], "stop"),
        ("one proxy has not reported since the promotion", AFTER, [("p1", AFTER, 0), ("p2", T0 - 1, 0)], "keep"),
        ("a sample inside the quiet period", AFTER, [("p1", AFTER, 0), ("p2", T0 + QUIET - 0.5, 0)], "keep"),
        ("a long request in flight at one proxy", AFTER, [("p1", AFTER, 0), ("p2", AFTER, 1)], "keep"),
        ("a WebSocket held until just before the window ends", T0 + WINDOW - 1, [("p1", AFTER, 3)], "keep"),
        ("in flight, but the window is over", T0 + WINDOW, [("p1", T0 + WINDOW, 3)], "stop"),
        ("no proxy reports at all", AFTER, [], "keep"),
    ],
)
def test_the_drain_ends_when_every_live_proxy_has_nothing_in_flight_to_the_old_release(
    case: str, now: float, reports: list[tuple[str, float, int]], expected: str
) -> None:
    b = draining_board()
    proxies = [proxy(b, pid, at, old_inflight=n) for pid, at, n in reports]
    assert outcome(b, now, proxies) == expected, case


def test_a_proxy_still_routing_by_the_routes_before_the_promotion_keeps_the_old_release() -> None:
    b = draining_board()
    assert outcome(b, AFTER, [proxy(b, "p1", AFTER), proxy(b, "p2", AFTER, behind=True)]) == "keep"


def test_a_proxy_that_cannot_count_everything_keeps_the_old_release() -> None:
    """An older proxy (no drain_counts), or an HAProxy worker from before a reload still holding
    connections it does not show in its counts."""
    b = draining_board()
    assert outcome(b, AFTER, [proxy(b, "p1", AFTER), proxy(b, "p2", AFTER, counts=False)]) == "keep"


def test_without_live_data_the_old_release_stays_for_the_whole_window() -> None:
    b = draining_board()
    assert outcome(b, T0 + WINDOW - 0.001, None) == "keep"
    assert outcome(b, T0 + WINDOW, None) == "stop"


def test_two_samples_of_zero_are_needed_when_the_quiet_period_spans_two_heartbeats() -> None:
    """A request routed to the old release just before the route change is counted by the sample that
    follows it: with the quiet period, the first zero sample right after the promotion does not stop it."""
    b = draining_board()
    timers = replace(TIMERS, drain_quiet=4.0)
    first, second = T0 + 2, T0 + 4
    assert outcome(b, first, [proxy(b, "p1", first)], timers) == "keep"
    assert outcome(b, second, [proxy(b, "p1", second, old_inflight=1)], timers) == "keep"
    later = T0 + 6
    assert outcome(b, later, [proxy(b, "p1", later)], timers) == "stop"


def forwarder(
    b: Board, node_id: str, at: float, *, old: int = 0, behind: bool = False, counts: bool = True
) -> cpb.Heartbeat:
    """A node's heartbeat sampled at ``at`` with its forwarder's counts."""
    hb = cpb.Heartbeat(node_id=node_id, time=to_timestamp(at), forwarder_counts=counts)
    hb.forwarder_routes_version = env_revision(b) - (1 if behind else 0)
    if old:
        hb.forwarder_old_connections[ENV] = old
    return hb


@pytest.mark.parametrize(
    ("case", "nodes", "expected"),
    [
        (
            "every forwarder has nothing open to the old release",
            [("n1", 0, False, True), ("n2", 0, False, True)],
            "stop",
        ),
        ("a connection through n2's forwarder still open", [("n1", 0, False, True), ("n2", 1, False, True)], "keep"),
        (
            "n2's forwarder still on the snapshot before the promotion",
            [("n1", 0, False, True), ("n2", 0, True, True)],
            "keep",
        ),
        ("n2 has no forwarder counts (an older agent)", [("n1", 0, False, True), ("n2", 0, False, False)], "keep"),
        ("no node reports", [], "keep"),
    ],
)
def test_an_env_reachable_over_the_private_network_also_waits_for_every_forwarder(
    case: str, nodes: list[tuple[str, int, bool, bool]], expected: str
) -> None:
    b = draining_board()
    env = b.view.env(ENV)
    assert env is not None
    with_port = copied(env)
    with_port.service.ports.add(name="db", container_port=5432)
    b.put(with_port)
    proxies = [proxy(b, "p1", AFTER)]
    heartbeats = [forwarder(b, n, AFTER, old=old, behind=behind, counts=counts) for n, old, behind, counts in nodes]
    t = decide(b.view, b.d(), AFTER, TIMERS, proxies, heartbeats)
    assert ("keep" if t is None else "stop") == expected, case
    assert outcome(b, T0 + WINDOW, proxies) == "stop"  # the window still bounds it


def test_an_old_node_heartbeat_from_before_the_quiet_period_keeps_the_old_release() -> None:
    b = draining_board()
    env = b.view.env(ENV)
    assert env is not None
    with_port = copied(env)
    with_port.service.ports.add(name="db", container_port=5432)
    b.put(with_port)
    stale = forwarder(b, "n1", T0 + 1)
    assert decide(b.view, b.d(), AFTER, TIMERS, [proxy(b, "p1", AFTER)], [stale]) is None
