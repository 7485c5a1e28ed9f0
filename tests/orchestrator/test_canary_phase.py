"""The canary phase as pure decisions (issue 41): a view in memory, a fake time, proxy heartbeats built by
hand. Advance, wait for the pause and the minimum requests, abort on 5xx, abort on latency, an operator's
promote and abort, and a new leader resuming at the same step."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, deployment_of
from services.orchestrator.phases import decide, wake_at
from shared import keys as K
from shared.canary import ABORT, LATENCY_BOUNDS_MS, PROMOTE, bucket_of, step_tag
from shared.clock import to_timestamp
from shared.decision import Decision
from tests.factories import node
from tests.orchestrator.rig import copied, deployment, environment, release, replica, spec
from tests.orchestrator.test_phases import ENV, HEALTHY, T0, Board

PH = pb.DeploymentPhase
CANARY = PH.DEPLOYMENT_PHASE_CANARY
TIMERS = Timers()
PAUSE = 30.0


def canary_spec() -> pb.ServiceSpec:
    s = spec(2)
    s.canary.steps.extend([5, 25, 50, 100])
    s.canary.pause.FromSeconds(int(PAUSE))
    s.canary.max_error_ratio = 0.01
    s.canary.max_latency_ratio = 1.5
    s.canary.min_requests = 100
    return s


def canary_board() -> Board:
    b = Board()
    s = canary_spec()
    blue = [replica("blue-0", "n1", ENV, "rel1"), replica("blue-1", "n2", ENV, "rel1")]
    b.put(
        node("n1", cpu=1000, mem=4096),
        node("n2", cpu=1000, mem=4096),
        release("rel1", ENV, "app:v1", s, version=1),
        release("rel2", ENV, "app:v2", s, version=2),
        environment(ENV, s, active="rel1"),
        *blue,
        deployment("dep1", ENV, "rel2", previous="rel1", now=T0),
    )
    b.observe(blue, HEALTHY)
    return b


def to_canary(b: Board) -> None:
    """PENDING -> PLACING -> STARTING -> HEALTHCHECKING -> CANARY step 0."""
    b.step()
    b.step()
    green = b.green()
    b.observe(green, HEALTHY)
    b.step()
    t = b.step()
    assert t is not None and deployment_of(t).phase == CANARY


def traffic(release_id: str, tag: str, requests: int, errors: int = 0, latency_ms: float = 10.0) -> cpb.ReleaseTraffic:
    buckets = [0] * (len(LATENCY_BOUNDS_MS) + 1)
    buckets[bucket_of(latency_ms)] = requests
    return cpb.ReleaseTraffic(
        environment_id=ENV,
        release_id=release_id,
        step_tag=tag,
        requests=requests,
        errors_5xx=errors,
        latency_buckets=buckets,
    )


def heartbeat(now: float, *traffics: cpb.ReleaseTraffic, proxy: str = "p1") -> cpb.ProxyHeartbeat:
    return cpb.ProxyHeartbeat(time=to_timestamp(now), proxy_id=proxy, release_traffic=list(traffics))


def step_traffic(
    b: Board, now: float, canary: int, errors: int = 0, canary_ms: float = 10.0, stable_ms: float = 10.0
) -> list[cpb.ProxyHeartbeat]:
    """Two proxies sharing the step's requests."""
    tag = step_tag("dep1", b.d().canary.step)
    half = canary // 2
    return [
        heartbeat(
            now, traffic("rel2", tag, half, errors // 2, canary_ms), traffic("rel1", tag, 19 * half, 0, stable_ms)
        ),
        heartbeat(
            now,
            traffic("rel2", tag, canary - half, errors - errors // 2, canary_ms),
            traffic("rel1", tag, 19 * (canary - half), 0, stable_ms),
            proxy="p2",
        ),
    ]


def decide_with(b: Board, now: float, proxies: list[cpb.ProxyHeartbeat]) -> Decision | None:
    return decide(b.view, b.d(), now, TIMERS, proxies)


def step_with(b: Board, now: float, proxies: list[cpb.ProxyHeartbeat]) -> Decision | None:
    t = decide_with(b, now, proxies)
    if t is not None:
        b.apply(t)
    return t


def test_a_healthy_green_set_enters_the_first_step_instead_of_promoting() -> None:
    b = canary_board()
    to_canary(b)
    d = b.d()
    assert (d.canary.step, d.canary.weight) == (0, 5)
    env = b.view.env(ENV)
    assert env is not None and env.active_release_id == "rel1"  # traffic not switched
    assert wake_at(b.view, d, TIMERS) == T0 + PAUSE


def test_red_green_stays_the_default() -> None:
    b = canary_board()
    for r in ("rel1", "rel2"):
        plain = copied(b.view.release(r))
        plain.service.ClearField("canary")
        b.put(plain)
    b.step()
    b.step()
    b.observe(b.green(), HEALTHY)
    b.step()
    t = b.step()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PROMOTING


def test_a_step_advances_only_after_the_pause_and_with_enough_requests() -> None:
    b = canary_board()
    to_canary(b)
    assert decide_with(b, T0 + 10, step_traffic(b, T0 + 10, 500)) is None  # pause not over
    assert decide_with(b, T0 + PAUSE + 1, step_traffic(b, T0 + PAUSE + 1, 60)) is None  # 60 < 100 requests
    t = step_with(b, T0 + PAUSE + 1, step_traffic(b, T0 + PAUSE + 1, 120))
    assert t is not None
    d = b.d()
    assert (d.phase, d.canary.step, d.canary.weight) == (CANARY, 1, 25)
    assert [e.kind for e in t.events] == ["deployment.canary_step"]
    assert t.events[0].fields["weight"] == "25"


def test_a_good_canary_goes_through_every_step_and_promotes() -> None:
    b = canary_board()
    to_canary(b)
    now = T0
    weights = [b.d().canary.weight]
    while b.d().phase == CANARY:
        now += PAUSE + 1
        assert step_with(b, now, step_traffic(b, now, 200)) is not None
        weights.append(b.d().canary.weight)
    assert b.d().phase == PH.DEPLOYMENT_PHASE_PROMOTING
    assert weights[:3] == [5, 25, 50]
    t = b.step(now + 1)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    env = b.view.env(ENV)
    assert env is not None and env.active_release_id == "rel2"


def test_counts_of_an_older_step_do_not_count() -> None:
    b = canary_board()
    to_canary(b)
    step_with(b, T0 + PAUSE + 1, step_traffic(b, T0 + PAUSE + 1, 200))
    assert b.d().canary.step == 1
    stale = [heartbeat(T0 + 2 * PAUSE + 2, traffic("rel2", step_tag("dep1", 0), 1000))]
    assert decide_with(b, T0 + 2 * PAUSE + 2, stale) is None


def test_five_hundreds_above_the_bound_abort_with_the_figures() -> None:
    b = canary_board()
    to_canary(b)
    t = step_with(b, T0 + 5, step_traffic(b, T0 + 5, 100, errors=10))  # 10 %, before the pause ends
    assert t is not None
    d = deployment_of(t)
    assert d.phase == PH.DEPLOYMENT_PHASE_FAILED
    assert d.error.startswith("canary aborted at step 0 (5%): 5xx ratio 10.00% above 1.00%")
    green = [a for a in b.view.assignments(ENV) if a.deployment_id == "dep1"]
    assert green == []
    aborted = next(e for e in t.events if e.kind == "deployment.canary_aborted")
    assert aborted.fields["error_ratio"] == "0.1000" and aborted.fields["max_error_ratio"] == "0.01"
    assert aborted.fields["requests"] == "100" and aborted.fields["trigger"] == "analysis"
    assert "deploy.failed" in [e.kind for e in t.events]


def test_errors_are_not_judged_before_the_minimum_requests() -> None:
    b = canary_board()
    to_canary(b)
    assert decide_with(b, T0 + 5, step_traffic(b, T0 + 5, 50, errors=10)) is None


def test_slow_canary_aborts_on_the_latency_bound() -> None:
    b = canary_board()
    to_canary(b)
    t = step_with(b, T0 + 5, step_traffic(b, T0 + 5, 200, canary_ms=300, stable_ms=100))
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert "p99 latency x3.00" in deployment_of(t).error
    aborted = next(e for e in t.events if e.kind == "deployment.canary_aborted")
    assert (aborted.fields["latency_ms"], aborted.fields["stable_latency_ms"]) == ("300", "100")


def test_fast_latencies_below_the_floor_are_not_judged() -> None:
    b = canary_board()
    to_canary(b)
    assert decide_with(b, T0 + 5, step_traffic(b, T0 + 5, 200, canary_ms=20, stable_ms=3)) is None


def request(b: Board, what: str) -> None:
    d = copied(b.view.deployment("dep1"))
    d.canary.requested, d.canary.requested_by = what, "operator"
    b.put(d)


def test_an_operators_promote_skips_the_remaining_steps() -> None:
    b = canary_board()
    to_canary(b)
    request(b, PROMOTE)
    t = b.step(T0 + 1)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PROMOTING


def test_an_operators_abort_stops_the_green_set_in_one_write() -> None:
    b = canary_board()
    to_canary(b)
    green = b.green()
    request(b, ABORT)
    t = b.step(T0 + 1)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert sorted(t.deletes) == sorted(K.assignment(a.node_id, a.meta.id) for a in green)
    aborted = next(e for e in t.events if e.kind == "deployment.canary_aborted")
    assert aborted.fields["trigger"] == "operator" and "aborted by operator" in deployment_of(t).error


def test_a_new_leader_resumes_at_the_same_step_with_the_same_weight() -> None:
    b = canary_board()
    to_canary(b)
    step_with(b, T0 + PAUSE + 1, step_traffic(b, T0 + PAUSE + 1, 200))
    recorded = copied(b.view.deployment("dep1"))
    # A new leader: only the record. Nothing happens before the step's own pause ends (not restarted).
    fresh = Board()
    fresh.state = b.state
    fresh.view = b.view
    assert decide(fresh.view, recorded, T0 + PAUSE + 5, TIMERS, []) is None
    assert (recorded.canary.step, recorded.canary.weight) == (1, 25)
    assert wake_at(fresh.view, recorded, TIMERS) == T0 + PAUSE + 1 + PAUSE
    later = T0 + 2 * PAUSE + 2
    t = decide(fresh.view, recorded, later, TIMERS, step_traffic(b, later, 200))
    assert t is not None and deployment_of(t).canary.weight == 50


def test_a_cancel_during_the_canary_aborts_like_before_promotion() -> None:
    b = canary_board()
    to_canary(b)
    d = copied(b.view.deployment("dep1"))
    d.error = "canceled by operator"
    b.put(d)
    t = b.step(T0 + 1)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
