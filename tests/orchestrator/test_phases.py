"""Pure phase decisions: ``decide(view, deployment, now, timers)`` over a view fed in memory (no NATS).

Each test pins one rule of the phase machine, in particular the fixes of the reference's hazards.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import Timers, deployment_of, phase_label
from services.orchestrator.phases import decide, wake_at
from shared import keys as K
from shared.clock import stamp
from shared.decision import Decision
from shared.deploy import CANCELED_BY_OPERATOR
from tests.factories import node
from tests.memory_state import MemoryState
from tests.orchestrator.rig import copied, deployment, environment, release, replica, spec

PH = pb.DeploymentPhase
RUN = pb.ASSIGNMENT_DESIRED_RUN
STOP = pb.ASSIGNMENT_DESIRED_STOP
HEALTHY = pb.INSTANCE_STATE_HEALTHY
RUNNING = pb.INSTANCE_STATE_RUNNING
UNHEALTHY = pb.INSTANCE_STATE_UNHEALTHY
STOPPED = pb.INSTANCE_STATE_STOPPED
T0 = 1_700_000_000.0
TIMERS = Timers()
ENV = "env-d"


class Board:
    """A view fed directly (what the watch would deliver), for pure decisions."""

    def __init__(self) -> None:
        self.state = MemoryState(name="board")
        self.view = self.state.store

    def put(self, *msgs: Message) -> None:
        self.state.put(*msgs)

    def observe(self, assignments: list[pb.Assignment], state: int) -> None:
        for a in assignments:
            observed = pb.AssignmentObserved(state=state, container_id=f"c-{a.meta.id}")  # type: ignore[arg-type]
            self.state.observe(a.node_id, a.meta.id, observed)

    def apply(self, t: Decision) -> None:
        """Commit a transition to the board as the loop would."""
        self.state.put(*t.creates, *t.puts)
        for key in t.deletes:
            self.state.delete(key)
        self.state.put(deployment_of(t))

    def d(self, deployment_id: str = "dep1") -> pb.Deployment:
        found = self.view.deployment(deployment_id)
        assert found is not None
        return found

    def decide(self, now: float = T0, deployment_id: str = "dep1", timers: Timers = TIMERS) -> Decision | None:
        return decide(self.view, self.d(deployment_id), now, timers)

    def step(self, now: float = T0, deployment_id: str = "dep1", timers: Timers = TIMERS) -> Decision | None:
        t = self.decide(now, deployment_id, timers)
        if t is not None:
            self.apply(t)
        return t

    def green(self, deployment_id: str = "dep1") -> list[pb.Assignment]:
        return [a for a in self.view.assignments(ENV) if a.deployment_id == deployment_id and a.desired == RUN]

    def at_phase(self, phase: int, deployment_id: str = "dep1", at: float = T0) -> None:
        d = copied(self.d(deployment_id))
        d.phase = phase  # type: ignore[assignment]
        stamp(d.meta.updated_at, at)
        self.put(d)


def red_green_board(*, min_replicas: int = 2, nodes: tuple[str, ...] = ("n1", "n2")) -> Board:
    b = Board()
    s = spec(min_replicas)
    b.put(
        *(node(n, cpu=1000, mem=4096) for n in nodes),
        release("rel1", ENV, "app:v1", s, version=1),
        release("rel2", ENV, "app:v2", s, version=2),
        environment(ENV, s, active="rel1"),
        replica("blue-0", "n1", ENV, "rel1"),
        replica("blue-1", "n2", ENV, "rel1"),
        deployment("dep1", ENV, "rel2", previous="rel1", now=T0),
    )
    return b


def stateful_board() -> Board:
    b = Board()
    s = spec(1, max_replicas=1, stateful=True, volume="data")
    volume = pb.Volume(project_id="p1", environment_id=ENV, name="data", node_id="n1", status=pb.VOLUME_STATUS_ACTIVE)
    volume.meta.id = "vol-data"
    blue0 = replica("blue-0", "n1", ENV, "rel1")
    b.put(
        node("n1", cpu=1000, mem=4096),
        node("n2", cpu=1000, mem=4096),
        release("rel1", ENV, "db:v1", s, version=1),
        release("rel2", ENV, "db:v2", s, version=2),
        environment(ENV, s, active="rel1"),
        volume,
        blue0,
        deployment("dep1", ENV, "rel2", previous="rel1", now=T0),
    )
    b.observe([blue0], HEALTHY)
    return b


def place_green(b: Board) -> list[pb.Assignment]:
    b.step()  # PENDING -> PLACING
    b.step()  # placed, -> STARTING
    assert b.d().phase == PH.DEPLOYMENT_PHASE_STARTING
    return b.green()


# ---------------------------------------------------------------------- guards


def test_missing_environment_aborts_with_the_reference_reason() -> None:
    b = Board()
    b.put(deployment("dep1", ENV, "rel2", now=T0))
    t = b.decide()
    assert (
        t is not None
        and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
        and deployment_of(t).error == "environment not found"
    )


def test_missing_release_aborts_with_the_reference_reason() -> None:
    b = Board()
    b.put(environment(ENV, spec(1)), deployment("dep1", ENV, "rel2", now=T0))
    t = b.decide()
    assert t is not None and deployment_of(t).error == "release not found"


def test_release_without_image_and_without_build_aborts() -> None:
    b = red_green_board()
    rel2 = copied(b.view.release("rel2"))
    assert rel2 is not None
    rel2.image_ref = ""
    b.put(rel2)
    t = b.decide()
    assert t is not None and deployment_of(t).error == "release has no image ref"


def test_terminal_deployments_are_never_revisited() -> None:
    b = red_green_board()
    b.at_phase(PH.DEPLOYMENT_PHASE_FAILED)
    assert b.decide() is None


def test_superseding_a_pre_promotion_deployment_deletes_its_green_in_the_same_write() -> None:
    b = red_green_board()
    green = place_green(b)
    b.put(deployment("dep2", ENV, "rel2", previous="rel1", now=T0 + 1))
    t = b.decide()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUPERSEDED
    assert sorted(t.deletes) == sorted(K.assignment(a.node_id, a.meta.id) for a in green)


def test_same_created_at_breaks_the_newer_tie_by_id() -> None:
    b = red_green_board()
    b.put(deployment("dep2", ENV, "rel2", previous="rel1", now=T0))
    t1, t2 = b.decide(deployment_id="dep1"), b.decide(deployment_id="dep2")
    assert t1 is not None and deployment_of(t1).phase == PH.DEPLOYMENT_PHASE_SUPERSEDED
    assert t2 is not None and deployment_of(t2).phase == PH.DEPLOYMENT_PHASE_PLACING


# ---------------------------------------------------------------------- readiness of the green set


@pytest.mark.parametrize("phase", [PH.DEPLOYMENT_PHASE_STARTING, PH.DEPLOYMENT_PHASE_HEALTHCHECKING])
def test_empty_green_set_is_not_ready_when_the_target_is_above_zero(phase: int) -> None:
    b = red_green_board()
    b.at_phase(phase)
    t = b.decide()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PLACING


@pytest.mark.parametrize("phase", [PH.DEPLOYMENT_PHASE_STARTING, PH.DEPLOYMENT_PHASE_HEALTHCHECKING])
def test_short_green_set_goes_back_to_placing(phase: int) -> None:
    b = red_green_board()
    green = place_green(b)
    b.observe(green, HEALTHY)
    b.apply(_deleting(b, green[:1]))
    b.at_phase(phase)
    t = b.decide()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PLACING


def _deleting(b: Board, assignments: list[pb.Assignment]) -> Decision:
    t = Decision("external delete", fence=copied(b.d()))
    t.deletes = [K.assignment(a.node_id, a.meta.id) for a in assignments]
    return t


def test_zero_target_passes_through_to_promotion_without_green() -> None:
    b = red_green_board(min_replicas=0)
    phases = []
    for _ in range(5):
        t = b.step()
        assert t is not None
        phases.append(deployment_of(t).phase)
    assert phases == [
        PH.DEPLOYMENT_PHASE_PLACING,
        PH.DEPLOYMENT_PHASE_STARTING,
        PH.DEPLOYMENT_PHASE_HEALTHCHECKING,
        PH.DEPLOYMENT_PHASE_PROMOTING,
        PH.DEPLOYMENT_PHASE_DRAINING_OLD,
    ]
    assert b.green() == []


def test_unhealthy_green_waits_for_the_health_deadline_instead_of_aborting() -> None:
    b = red_green_board()
    green = place_green(b)
    b.observe(green, RUNNING)
    b.step()
    b.observe(green[:1], UNHEALTHY)
    assert b.decide(T0 + 100) is None
    t = b.decide(T0 + 180.001)
    assert t is not None and deployment_of(t).error == "green instances did not become healthy in time"


def test_health_deadline_is_twice_the_release_grace_plus_a_minute() -> None:
    b = red_green_board()
    rel2 = copied(b.view.release("rel2"))
    assert rel2 is not None
    rel2.service.healthcheck.grace_period.seconds = 30
    b.put(rel2)
    green = place_green(b)
    b.observe(green, RUNNING)
    b.step()
    assert b.decide(T0 + 120) is None
    t = b.decide(T0 + 120.001)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED


# ---------------------------------------------------------------------- placement


def test_placing_and_entering_starting_are_one_write() -> None:
    b = red_green_board()
    b.step()
    t = b.decide()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_STARTING
    assert [a.node_id for a in t.creates if isinstance(a, pb.Assignment)] == ["n1", "n2"]
    assert all(a.deployment_id == "dep1" and a.config_hash == "hash-rel2" for a in t.creates)  # type: ignore[attr-defined]


def test_partial_placement_stays_in_placing_and_fences_the_unchanged_deployment() -> None:
    b = red_green_board(min_replicas=3, nodes=("n1",))
    b.put(node("n1", cpu=1000, mem=768))  # blue-0 reserves 256 MB: room for two greens
    b.step()
    t = b.decide()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PLACING
    assert len(t.creates) == 2
    assert deployment_of(t) == b.d()


def test_top_ups_may_use_nodes_already_holding_green() -> None:
    b = red_green_board(min_replicas=2, nodes=("n1",))
    b.step()
    b.put(node("n1", cpu=1000, mem=512))  # room for one green only
    b.step()
    assert len(b.green()) == 1
    b.put(node("n1", cpu=1000, mem=4096))  # capacity grows on the same node
    t = b.step()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_STARTING
    assert [a.node_id for a in b.green()] == ["n1", "n1"]


def test_no_capacity_waits_in_placing_without_writing() -> None:
    b = red_green_board(nodes=("n1",))
    b.put(node("n1", cpu=1000, mem=256))
    b.step()
    assert b.decide(T0 + 599) is None


@pytest.mark.parametrize("phase", [PH.DEPLOYMENT_PHASE_STARTING, PH.DEPLOYMENT_PHASE_HEALTHCHECKING])
def test_green_on_a_down_node_is_deleted_and_replaced_before_promotion(phase: int) -> None:
    b = red_green_board(nodes=("n1", "n2", "n3"))
    green = place_green(b)
    b.observe(green, HEALTHY)
    b.at_phase(phase)
    lost = green[0]
    b.put(node(lost.node_id, status=pb.NODE_STATUS_DOWN))
    t = b.step()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PLACING
    assert t.deletes == [K.assignment(lost.node_id, lost.meta.id)]
    t = b.step()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_STARTING
    [replacement] = t.creates
    assert isinstance(replacement, pb.Assignment) and replacement.node_id != lost.node_id
    assert lost.node_id not in {a.node_id for a in b.green()}


def test_green_on_a_down_node_is_not_replaced_once_promoted() -> None:
    b = red_green_board()
    green = place_green(b)
    b.observe(green, HEALTHY)
    for _ in range(3):
        b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    b.put(node("n1", status=pb.NODE_STATUS_DOWN))
    assert b.decide(T0) is None  # the scheduler owns the active release's replicas again


# ---------------------------------------------------------------------- timeouts


def _queued_build_board() -> Board:
    b = red_green_board()
    rel2 = copied(b.view.release("rel2"))
    assert rel2 is not None
    rel2.image_ref = ""
    build = pb.Build(environment_id=ENV, status=pb.BUILD_STATUS_QUEUED)
    build.meta.id = "b1"
    d = copied(b.d())
    d.build_id = "b1"
    b.put(rel2, build, d)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_BUILDING
    return b


def _starting_board() -> Board:
    b = red_green_board()
    place_green(b)
    return b


def _placing_without_capacity_board() -> Board:
    b = red_green_board(nodes=("n1",))
    b.put(node("n1", cpu=1000, mem=256))
    b.step()
    return b


def _stopping_old_board() -> Board:
    b = stateful_board()
    b.step()
    b.step()  # the old instance is flipped to STOP but still reports HEALTHY
    assert b.d().phase == PH.DEPLOYMENT_PHASE_STOPPING_OLD
    return b


def _stateful_starting_board() -> Board:
    b = stateful_board()
    b.step()
    b.step()
    b.observe([a for a in b.view.assignments(ENV) if a.meta.id == "blue-0"], STOPPED)
    b.step()
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_STARTING and len(b.green()) == 1
    return b


@pytest.mark.parametrize(
    ("make", "limit", "reason"),
    [
        (_queued_build_board, 1800, "BUILDING timed out after 30m: build b1 is still QUEUED"),
        (
            _placing_without_capacity_board,
            600,
            "PLACING timed out after 10m: placed 0 of 2 green replicas: "
            "placement: only 0 of 2 replicas placeable for env env-d (constraints/capacity)",
        ),
        (_starting_board, 600, "STARTING timed out after 10m: 2 of 2 green instances not running (2 unreported)"),
        (_stopping_old_board, 300, "STOPPING_OLD timed out after 5m: the old instance blue-0 on n1 is still HEALTHY"),
        (_stateful_starting_board, 600, "STARTING timed out after 10m: the new instance on n1 is still unreported"),
    ],
    ids=["building", "placing", "starting", "stopping_old", "stateful_starting"],
)
def test_every_waiting_phase_times_out_with_a_reason_naming_phase_and_cause(
    make: Callable[[], Board], limit: int, reason: str
) -> None:
    b = make()
    assert b.decide(T0 + limit) is None  # strictly after the limit
    t = b.decide(T0 + limit + 0.001)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert deployment_of(t).error == reason
    assert [e.kind for e in t.events][-1] == "deploy.failed"


def test_stateful_timeouts_after_the_stop_restart_the_old_instance() -> None:
    b = _stopping_old_board()
    t = b.decide(T0 + 301)
    assert t is not None
    assert [(a.meta.id, a.desired) for a in t.puts] == [("blue-0", RUN)]  # type: ignore[attr-defined]
    assert [e.kind for e in t.events] == ["deploy.rolled_back", "deploy.failed"]


def test_timeouts_are_configurable() -> None:
    b = _placing_without_capacity_board()
    short = Timers(placing_timeout=30)
    assert b.decide(T0 + 30, timers=short) is None
    t = b.decide(T0 + 31, timers=short)
    assert t is not None and deployment_of(t).error.startswith("PLACING timed out after 30s: ")


def test_a_deployment_never_stamped_with_a_phase_entry_runs_no_timer() -> None:
    b = _queued_build_board()
    d = copied(b.d())
    d.meta.ClearField("updated_at")
    b.put(d)
    assert b.decide(T0 + 10 * 3600) is None
    assert wake_at(b.view, b.d(), TIMERS) is None


# ---------------------------------------------------------------------- abort and promotion


def test_abort_deletes_the_green_set_and_fails_in_one_transition() -> None:
    b = red_green_board()
    green = place_green(b)
    b.observe(green[1:], pb.INSTANCE_STATE_FAILED)
    t = b.decide(T0 + 5)
    assert t is not None
    assert (
        deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
        and deployment_of(t).error == "a green instance failed to start"
    )
    assert sorted(t.deletes) == sorted(K.assignment(a.node_id, a.meta.id) for a in green)
    assert t.puts == [] and t.creates == []


def test_promotion_switches_traffic_and_enters_draining_old_in_one_transition() -> None:
    b = red_green_board()
    green = place_green(b)
    b.observe(green, HEALTHY)
    b.step()
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_PROMOTING
    t = b.decide(T0 + 7)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    [env] = t.puts
    assert isinstance(env, pb.Environment)
    assert env.active_release_id == "rel2" and env.route_generation == 1
    assert deployment_of(t).promoted_at.ToSeconds() == T0 + 7
    assert deployment_of(t).drain_deadline.ToSeconds() == T0 + 7 + 600


def test_drain_waits_for_its_deadline_and_completes_exactly_at_it() -> None:
    b = red_green_board()
    green = place_green(b)
    b.observe(green, HEALTHY)
    for _ in range(3):
        b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    assert wake_at(b.view, b.d(), TIMERS) == T0 + 600
    assert b.decide(T0 + 599.999) is None
    t = b.decide(T0 + 600)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert sorted((a.meta.id, a.desired) for a in t.puts) == [("blue-0", STOP), ("blue-1", STOP)]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- rollback and redeploy


def _promoted_rel2_board() -> Board:
    """rel2 active (promoted, still draining) with rel1's replicas warm and healthy."""
    b = red_green_board()
    green = place_green(b)
    b.observe(green, HEALTHY)
    for _ in range(3):
        b.step()
    b.observe([a for a in b.view.assignments(ENV) if a.release_id == "rel1"], HEALTHY)
    return b


def test_warm_rollback_promotes_without_placing() -> None:
    b = _promoted_rel2_board()
    b.put(deployment("roll1", ENV, "rel1", previous="rel2", now=T0 + 60, is_rollback=True))
    t = b.decide(T0 + 60, deployment_id="roll1")
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PROMOTING


def test_rollback_is_not_warm_when_a_replica_sits_on_a_lost_node() -> None:
    b = _promoted_rel2_board()
    b.put(node("n1", status=pb.NODE_STATUS_DOWN))
    b.put(deployment("roll1", ENV, "rel1", previous="rel2", now=T0 + 60, is_rollback=True))
    t = b.decide(T0 + 60, deployment_id="roll1")
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_PLACING


def test_rollback_to_the_active_release_never_stops_the_live_replicas() -> None:
    b = red_green_board()
    b.observe([a for a in b.view.assignments(ENV) if a.release_id == "rel1"], HEALTHY)
    b.put(deployment("roll1", ENV, "rel1", previous="rel1", now=T0 + 1, is_rollback=True))
    b.at_phase(PH.DEPLOYMENT_PHASE_SUPERSEDED)
    b.step(T0 + 1, deployment_id="roll1")
    assert b.d("roll1").phase == PH.DEPLOYMENT_PHASE_PROMOTING  # warm: no new replicas
    t = b.step(T0 + 1, deployment_id="roll1")
    # Nothing to drain (the live replicas are the target): it succeeds at promotion, stopping nothing.
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert [type(m).__name__ for m in t.puts] == ["Environment"]
    assert len([a for a in b.view.assignments(ENV) if a.desired == RUN]) == 2


def test_redeploy_of_the_same_release_stops_only_the_previous_set() -> None:
    b = red_green_board()
    b.put(deployment("dep2", ENV, "rel1", previous="rel1", now=T0 + 1))
    b.at_phase(PH.DEPLOYMENT_PHASE_SUPERSEDED)
    b.step(T0 + 1, deployment_id="dep2")
    b.step(T0 + 1, deployment_id="dep2")
    fresh = b.green("dep2")
    assert len(fresh) == 2
    b.observe(fresh, HEALTHY)
    for _ in range(3):
        b.step(T0 + 1, deployment_id="dep2")
    t = b.step(T0 + 1000, deployment_id="dep2")
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert sorted(a.meta.id for a in t.puts) == ["blue-0", "blue-1"]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- cancel


def _cancel(b: Board, deployment_id: str = "dep1") -> None:
    d = copied(b.d(deployment_id))
    d.error = CANCELED_BY_OPERATOR
    b.put(d)


def test_cancel_before_promotion_fails_and_removes_green_leaving_traffic_alone() -> None:
    b = red_green_board()
    green = place_green(b)
    _cancel(b)
    t = b.step()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert deployment_of(t).error == "canceled by operator"
    assert sorted(t.deletes) == sorted(K.assignment(a.node_id, a.meta.id) for a in green)
    assert t.puts == []
    env = b.view.env(ENV)
    assert env is not None and env.active_release_id == "rel1"


def test_cancel_of_a_stateful_deployment_after_the_stop_restarts_the_old_instance() -> None:
    b = _stateful_starting_board()
    _cancel(b)
    t = b.step()
    assert t is not None and deployment_of(t).error == "canceled by operator"
    assert b.green() == []
    assert [a.desired for a in b.view.assignments(ENV) if a.meta.id == "blue-0"] == [RUN]


# ---------------------------------------------------------------------- stateful specifics


def test_stateful_start_with_no_node_for_the_volume_fails_at_once_and_restarts_old() -> None:
    b = stateful_board()
    b.step()
    b.step()
    b.observe([a for a in b.view.assignments(ENV) if a.meta.id == "blue-0"], STOPPED)
    b.step()
    b.put(node("n1", status=pb.NODE_STATUS_DOWN))
    t = b.step()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert deployment_of(t).error.startswith("no node available for the stateful instance: placement: ")
    assert [a.desired for a in b.view.assignments(ENV) if a.meta.id == "blue-0"] == [RUN]


def test_stateful_start_waits_while_the_volume_is_restoring_then_places_on_its_node() -> None:
    """Before: the new instance was placed (and started once leased) while a restore replaced the volume."""
    b = stateful_board()
    b.step()
    b.step()
    b.observe([a for a in b.view.assignments(ENV) if a.meta.id == "blue-0"], STOPPED)
    b.step()
    assert b.d().phase == PH.DEPLOYMENT_PHASE_STARTING
    volume = copied(b.view.volume("vol-data"))
    volume.status = pb.VOLUME_STATUS_RESTORING
    b.put(volume)
    assert b.step(T0 + 1) is None and b.green() == []
    volume = copied(volume)
    volume.status = pb.VOLUME_STATUS_ACTIVE
    b.put(volume)
    t = b.step(T0 + 2)
    assert t is not None and [a.node_id for a in b.green()] == ["n1"]


def test_stateful_start_waiting_for_a_restore_times_out_and_restarts_old() -> None:
    b = stateful_board()
    b.step()
    b.step()
    b.observe([a for a in b.view.assignments(ENV) if a.meta.id == "blue-0"], STOPPED)
    b.step()
    volume = copied(b.view.volume("vol-data"))
    volume.status = pb.VOLUME_STATUS_RESTORING
    b.put(volume)
    assert b.decide(T0 + 600) is None
    t = b.step(T0 + 600.001)
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_FAILED
    assert deployment_of(t).error == 'STARTING timed out after 10m: volume "data" is still being restored'
    assert [a.desired for a in b.view.assignments(ENV) if a.meta.id == "blue-0"] == [RUN]


def test_stateful_health_requires_a_non_empty_healthy_set() -> None:
    b = stateful_board()
    b.at_phase(PH.DEPLOYMENT_PHASE_HEALTHCHECKING)
    assert b.decide() is None


def test_stateful_promotion_switches_traffic_and_succeeds_in_one_transition() -> None:
    b = stateful_board()
    b.at_phase(PH.DEPLOYMENT_PHASE_PROMOTING)
    t = b.decide()
    assert t is not None and deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED
    [env] = t.puts
    assert isinstance(env, pb.Environment) and env.active_release_id == "rel2" and env.route_generation == 1
    assert [e.kind for e in t.events] == ["deploy.maintenance_end", "deploy.succeeded"]


# ---------------------------------------------------------------------- wake-ups


@pytest.mark.parametrize(
    ("phase", "due"),
    [
        (PH.DEPLOYMENT_PHASE_PENDING, None),
        (PH.DEPLOYMENT_PHASE_BUILDING, 1800.001),
        (PH.DEPLOYMENT_PHASE_PLACING, 600.001),
        (PH.DEPLOYMENT_PHASE_STARTING, 600.001),
        (PH.DEPLOYMENT_PHASE_HEALTHCHECKING, 180.001),
        (PH.DEPLOYMENT_PHASE_PROMOTING, None),
        (PH.DEPLOYMENT_PHASE_STOPPING_OLD, 300.001),
        (PH.DEPLOYMENT_PHASE_SUCCEEDED, None),
    ],
)
def test_wake_at_is_the_instant_time_alone_changes_the_decision(phase: int, due: float | None) -> None:
    b = red_green_board()
    b.at_phase(phase)
    got = wake_at(b.view, b.d(), TIMERS)
    assert (got is None) == (due is None)
    if due is not None:
        assert got == pytest.approx(T0 + due)


# ---------------------------------------------------------------------- drain: nothing locked out


def _promote(b: Board) -> Decision:
    """Place green, see it healthy, and promote; returns the promotion."""
    b.observe(place_green(b), HEALTHY)
    b.step()  # STARTING -> HEALTHCHECKING
    b.step()  # -> PROMOTING
    t = b.step()
    assert t is not None and t.label.startswith("PROMOTING->")
    return t


def test_a_first_deploy_has_nothing_to_drain_and_succeeds_at_promotion() -> None:
    b = Board()
    s = spec(2)
    b.put(
        node("n1", cpu=1000, mem=4096),
        node("n2", cpu=1000, mem=4096),
        release("rel1", ENV, "app:v1", s),
        environment(ENV, s),
        deployment("dep1", ENV, "rel1", now=T0),
    )
    t = _promote(b)
    assert deployment_of(t).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED
    assert deployment_of(t).HasField("promoted_at") and not deployment_of(t).HasField("drain_deadline")
    env = b.view.env(ENV)
    assert env is not None and env.active_release_id == "rel1"
    assert wake_at(b.view, b.d(), TIMERS) is None  # no timer left running


def test_a_deploy_whose_blue_is_already_gone_succeeds_at_promotion() -> None:
    b = red_green_board()
    b.put(*(copied_with_desired(a, STOP) for a in b.view.assignments(ENV) if a.release_id == "rel1"))
    assert deployment_of(_promote(b)).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED


def copied_with_desired(a: pb.Assignment, desired: int) -> pb.Assignment:
    c = copied(a)
    c.desired = desired  # type: ignore[assignment]
    return c


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda b: b.put(_cooled(b)), "the env cooled to zero: its warm blue cools with it"),
        (
            lambda b: b.put(*(copied_with_desired(a, STOP) for a in b.view.assignments(ENV) if a.release_id == "rel1")),
            "blue stopped by someone else: nothing left to keep warm",
        ),
    ],
)
def test_the_drain_ends_before_its_window_when_nothing_is_left_to_keep_warm(
    change: Callable[[Board], None], why: str
) -> None:
    b = red_green_board()
    t = _promote(b)
    assert deployment_of(t).phase == PH.DEPLOYMENT_PHASE_DRAINING_OLD
    assert b.step(T0 + 1) is None, "the window is open and blue is warm"
    change(b)
    done = b.step(T0 + 1)
    assert done is not None and deployment_of(done).phase == PH.DEPLOYMENT_PHASE_SUCCEEDED, why
    assert all(a.desired == STOP for a in b.view.assignments(ENV) if a.release_id == "rel1")


def _cooled(b: Board) -> pb.Environment:
    env = copied(b.view.env(ENV))
    env.service.scale_to_zero = True
    env.effective_replicas = 0
    return env


def test_a_phase_this_build_does_not_know_is_labelled_by_its_number() -> None:
    assert phase_label(PH.DEPLOYMENT_PHASE_FAILED) == "FAILED"
    assert phase_label(124) == "UNKNOWN(124)"  # garbage in the store must not fail the pass that logs it
