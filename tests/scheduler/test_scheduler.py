"""The placement loop, one pass at a time on real NATS."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from tests.factories import assignment
from tests.scheduler.builders import deployment, pnode, spec_env, spec_release, unlimited, volume
from tests.scheduler.conftest import Rig

RUN = pb.ASSIGNMENT_DESIRED_RUN
STOP = pb.ASSIGNMENT_DESIRED_STOP


async def add_env_release(rig: Rig, min_replicas: int, *, env_id: str = "env1", rel_id: str = "rel1") -> pb.Release:
    """The spec's ``addEnvRelease``."""
    rel = spec_release(rel_id, env_id, min_replicas=min_replicas)
    await rig.put(rel, spec_env(env_id, rel))
    return rel


async def three_replicas(rig: Rig) -> None:
    await rig.put(unlimited("n1"), unlimited("n2"), unlimited("n3"))
    await add_env_release(rig, 3)
    await rig.pass_()


# ---------------------------------------------------------------- §4.4 scheduler_test.go


async def test_scale_up_from_zero_places_one_replica_per_node(rig: Rig):
    await three_replicas(rig)
    assert rig.run_nodes("env1") == ["n1", "n2", "n3"]
    a = rig.run("env1")[0]
    assert (a.config_hash, a.release_id, a.deployment_id, a.job_id) == ("hash-v1", "rel1", "", "")
    assert a.meta.created_at.seconds == int(rig.clock.now())


async def test_scale_down_stops_the_newest_replicas(rig: Rig):
    await three_replicas(rig)
    env = spec_env("env1", rig.view.release("rel1"), min_replicas=1)
    env.service.replicas.max = 6
    await rig.put(env)
    await rig.pass_()
    assert rig.run_nodes("env1") == ["n1"]
    assert sorted(a.node_id for a in rig.stop("env1")) == ["n2", "n3"]


async def test_stateless_replica_on_down_node_is_deleted_and_replaced(rig: Rig):
    await three_replicas(rig)
    lost = next(a for a in rig.run("env1") if a.node_id == "n3")
    await rig.set_node("n3", pb.NODE_STATUS_DOWN)
    await rig.pass_()
    assert rig.view.assignment(lost.meta.id) is None
    assert rig.run_nodes("env1") == ["n1", "n1", "n2"]


async def test_repeated_passes_never_place_twice(rig: Rig):
    await three_replicas(rig)
    await rig.pass_()
    await rig.pass_()
    assert len(rig.assignments("env1")) == 3 and rig.run_nodes("env1") == ["n1", "n2", "n3"]


async def test_env_without_active_release_gets_nothing(rig: Rig):
    await rig.put(unlimited("n1"), spec_env("env1", None, min_replicas=2))
    await rig.pass_()
    assert rig.assignments("env1") == []


# ---------------------------------------------------------------- §4.5 drain_test.go


async def test_drain_moves_stateless_stops_stateful_and_ends_drained(rig: Rig):
    rel_s = spec_release("relS", "envS", min_replicas=1)
    rel_f = spec_release("relF", "envF", min_replicas=1, stateful=True, volumes=("data",))
    await rig.put(unlimited("n1"), unlimited("n2"), rel_s, rel_f)
    await rig.put(spec_env("envS", rel_s), spec_env("envF", rel_f, project_id="p1"))
    await rig.put(
        volume("vol-data", "envF", "data", "n1"),
        assignment("n1", "envS", "relS", assignment_id="sless"),
        assignment("n1", "envF", "relF", assignment_id="sfull"),
    )
    await rig.observe("sless", pb.INSTANCE_STATE_HEALTHY)
    await rig.observe("sfull", pb.INSTANCE_STATE_HEALTHY)
    await rig.set_node("n1", pb.NODE_STATUS_DRAINING, schedulable=False)

    await rig.pass_()
    replacement = next(a for a in rig.run("envS") if a.node_id == "n2")
    assert rig.view.assignment("sfull").desired == STOP
    assert rig.view.assignment("sless").desired == RUN  # the replacement has not reported yet
    kinds = await rig.kinds()
    assert "node.drain.stateful_stopped" in kinds and "schedule.no_capacity" in kinds
    drained_event = next(e for e in rig.events if e.kind == "node.drain.stateful_stopped")
    assert drained_event.node_id == "n1"
    assert drained_event.message == "stopped 1 stateful service(s) on the draining node (volumes are pinned here)"
    assert rig.view.volume("vol-data").status == pb.VOLUME_STATUS_NODE_LOST

    await rig.observe(replacement.meta.id, pb.INSTANCE_STATE_HEALTHY)
    await rig.observe("sfull", pb.INSTANCE_STATE_STOPPED)
    await rig.pass_()
    assert rig.view.assignment("sless").desired == STOP
    assert rig.view.assignment("sfull") is None

    await rig.observe("sless", pb.INSTANCE_STATE_STOPPED)
    await rig.pass_()
    assert rig.view.assignments_by_node("n1") == []
    assert rig.view.node("n1").status == pb.NODE_STATUS_DRAINED
    assert rig.view.node("n1").schedulable is False


# ---------------------------------------------------------------- §4.6 teardown_test.go


async def test_env_deletion_stops_then_reaps_its_replicas_in_two_passes(rig: Rig):
    await rig.put(unlimited("n1"), unlimited("n2"))
    await add_env_release(rig, 2)
    await rig.pass_()
    assert len(rig.run("env1")) == 2
    await rig.delete(K.env("env1"))
    await rig.pass_()
    assert rig.run("env1") == [] and len(rig.stop("env1")) == 2
    for a in rig.stop("env1"):
        await rig.observe(a.meta.id, pb.INSTANCE_STATE_STOPPED)
    await rig.pass_()
    assert rig.assignments("env1") == []


async def test_assignment_of_a_vanished_release_is_stopped_as_an_orphan(rig: Rig):
    await rig.put(
        unlimited("n1"), spec_env("env1", None), assignment("n1", "env1", "ghost-release", assignment_id="orphan1")
    )
    await rig.pass_()
    assert rig.view.assignment("orphan1").desired == STOP


# ---------------------------------------------------------------- §4.11 derived cases 50–54


async def test_deployment_under_way_freezes_the_env(rig: Rig):
    await three_replicas(rig)
    await rig.put(spec_release("rel2", "env1"), deployment("dep1", "env1", "rel2", "rel1", pb.DEPLOYMENT_PHASE_PLACING))
    await rig.set_node("n3", pb.NODE_STATUS_DOWN)
    await rig.pass_()
    assert rig.run_nodes("env1") == ["n1", "n2", "n3"]


async def test_promoted_deployment_lets_the_scheduler_replace_active_replicas_fix_draining_old_freeze(rig: Rig):
    """Reference: DRAINING_OLD froze the env for 10 minutes (no replacement of the lost n3 replica)."""
    await rig.put(unlimited("n1"), unlimited("n2"), unlimited("n3"))
    blue = spec_release("rel1", "env1", min_replicas=2)
    green = spec_release("rel2", "env1", min_replicas=2)
    await rig.put(blue, green, spec_env("env1", green))
    await rig.put(
        assignment("n1", "env1", "rel1", assignment_id="blue-0"),
        assignment("n2", "env1", "rel1", assignment_id="blue-1"),
        assignment("n2", "env1", "rel2", assignment_id="green-0"),
        assignment("n3", "env1", "rel2", assignment_id="green-1"),
        deployment("dep1", "env1", "rel2", "rel1", pb.DEPLOYMENT_PHASE_DRAINING_OLD),
    )
    await rig.set_node("n3", pb.NODE_STATUS_DOWN)
    await rig.pass_()
    assert rig.view.assignment("green-1") is None
    assert sorted(a.node_id for a in rig.run("env1") if a.release_id == "rel2") == ["n1", "n2"]
    assert {a.meta.id for a in rig.run("env1") if a.release_id == "rel1"} == {"blue-0", "blue-1"}


async def test_redeploy_of_the_active_release_keeps_its_new_replicas_while_draining(rig: Rig):
    """A deployment whose target is its previous release (a redeploy, a rollback to the active release):
    blue and green share the release. The scheduler must count only green at DRAINING_OLD, or it stops
    the new replicas (the newest) as surplus and the drain is left with the old ones."""
    await rig.put(unlimited("n1"), unlimited("n2"), unlimited("n3"))
    rel = spec_release("rel1", "env1", min_replicas=2)
    await rig.put(rel, spec_env("env1", rel))
    old = [assignment(n, "env1", "rel1", assignment_id=f"old-{n}") for n in ("n1", "n2")]
    for a in old:
        a.meta.created_at.FromSeconds(int(rig.clock.now()) - 600)
    dep = deployment("dep1", "env1", "rel1", "rel1", pb.DEPLOYMENT_PHASE_DRAINING_OLD)
    dep.meta.created_at.FromSeconds(int(rig.clock.now()) - 60)
    new = [assignment(n, "env1", "rel1", assignment_id=f"new-{n}") for n in ("n2", "n3")]
    for a in new:
        a.deployment_id = "dep1"
        a.meta.created_at.FromSeconds(int(rig.clock.now()) - 30)
    await rig.put(*old, *new, dep)
    await rig.pass_()
    assert {a.meta.id for a in rig.run("env1")} == {"old-n1", "old-n2", "new-n2", "new-n3"}

    await rig.set_node("n3", pb.NODE_STATUS_DOWN)
    await rig.pass_()
    await rig.pass_()
    replacements = [a for a in rig.run("env1") if a.meta.id not in {"old-n1", "old-n2", "new-n2"}]
    assert len(replacements) == 1, "the lost green replica is replaced once, not on every pass"


async def test_failed_replica_is_replaced_on_another_node_fix_failed_never_replaced(rig: Rig):
    """Reference: FAILED replicas count as good; nothing is written."""
    await rig.put(unlimited("n1"), unlimited("n2"), unlimited("n3"))
    await add_env_release(rig, 2)
    await rig.pass_()
    broken = next(a for a in rig.run("env1") if a.node_id == "n1")
    await rig.observe(broken.meta.id, pb.INSTANCE_STATE_FAILED, "exit 1")
    await rig.pass_()
    assert rig.view.assignment(broken.meta.id).desired == STOP
    assert rig.run_nodes("env1") == ["n2", "n3"]
    await rig.settle_events()
    (event,) = [e for e in rig.events if e.kind == "schedule.replica_failed"]
    assert event.environment_id == "env1" and event.severity == "warning"
    assert event.message == f"replica {broken.meta.id} on node n1 failed: exit 1; replaced on node n3"


async def test_failed_replacements_back_off_exponentially_per_env(rig: Rig):
    await rig.put(unlimited("n1"), unlimited("n2"))
    await add_env_release(rig, 1)
    await rig.pass_()

    async def fail_current() -> str:
        (current,) = rig.run("env1")
        await rig.observe(current.meta.id, pb.INSTANCE_STATE_FAILED)
        return current.meta.id

    first = await fail_current()
    await rig.pass_()
    assert rig.view.assignment(first).desired == STOP  # replaced at once
    second = await fail_current()
    await rig.pass_()
    assert rig.view.assignment(second).desired == RUN  # within 10 s of the last replacement
    assert rig.scheduler.seconds_until_due() == 10.0
    await rig.clock.advance(10)
    await rig.pass_()
    assert rig.view.assignment(second).desired == STOP
    third = await fail_current()
    await rig.clock.advance(19)
    await rig.pass_()
    assert rig.view.assignment(third).desired == RUN  # the window doubled to 20 s
    await rig.clock.advance(1)
    await rig.pass_()
    assert rig.view.assignment(third).desired == STOP


async def test_scale_down_stops_failed_replicas_before_the_newest(rig: Rig):
    await three_replicas(rig)
    oldest = min(rig.run("env1"), key=lambda a: a.meta.id)
    await rig.observe(oldest.meta.id, pb.INSTANCE_STATE_FAILED)
    env = spec_env("env1", rig.view.release("rel1"), min_replicas=2)
    await rig.put(env)
    await rig.pass_()
    assert [a.meta.id for a in rig.stop("env1")] == [oldest.meta.id]


async def test_cordoned_node_replica_stays_good(rig: Rig):
    await three_replicas(rig)
    before = {a.meta.id: rig.view.rev(K.assignment(a.node_id, a.meta.id)) for a in rig.assignments("env1")}
    await rig.set_node("n2", pb.NODE_STATUS_ALIVE, schedulable=False)
    await rig.pass_()
    after = {a.meta.id: rig.view.rev(K.assignment(a.node_id, a.meta.id)) for a in rig.assignments("env1")}
    assert before == after


async def test_stale_release_on_down_node_is_stopped_then_reaped_fix_stop_leak(rig: Rig):
    """Reference: flipped to STOP and left until the node returns and reports STOPPED."""
    await rig.put(unlimited("n1"), unlimited("n2"))
    await add_env_release(rig, 0)
    await rig.put(spec_release("rel0", "env1"), assignment("n2", "env1", "rel0", assignment_id="old"))
    await rig.set_node("n2", pb.NODE_STATUS_DOWN)
    await rig.pass_()
    assert rig.view.assignment("old").desired == STOP
    await rig.pass_()
    assert rig.view.assignment("old") is None


async def test_missing_active_release_writes_nothing_and_orphans_its_replicas(rig: Rig):
    await rig.put(unlimited("n1"))
    env = spec_env("env1", None, min_replicas=2)
    env.active_release_id = "gone"
    await rig.put(env, assignment("n1", "env1", "gone", assignment_id="a1"))
    await rig.pass_()
    assert [(a.meta.id, a.desired) for a in rig.assignments("env1")] == [("a1", STOP)]


# ---------------------------------------------------------------- leaks and repeated events (fixes)


async def test_stop_assignment_on_gone_node_is_deleted_fix_stop_leak(rig: Rig):
    await rig.put(unlimited("n1"))
    await add_env_release(rig, 0)
    await rig.put(assignment("gone-node", "env1", "rel1", assignment_id="s1", desired=STOP))
    await rig.pass_()
    assert rig.view.assignment("s1") is None


async def test_stop_assignment_never_reported_is_deleted_after_5_minutes_fix_stop_leak(rig: Rig):
    await three_replicas(rig)
    await rig.put(spec_env("env1", rig.view.release("rel1"), min_replicas=2))
    await rig.pass_()
    (stopping,) = rig.stop("env1")
    await rig.clock.advance(299)
    await rig.pass_()
    assert rig.view.assignment(stopping.meta.id) is not None
    await rig.clock.advance(1)
    await rig.pass_()
    assert rig.view.assignment(stopping.meta.id) is None


async def test_stop_assignment_still_running_is_kept_until_stopped(rig: Rig):
    await three_replicas(rig)
    await rig.put(spec_env("env1", rig.view.release("rel1"), min_replicas=2))
    await rig.pass_()
    (stopping,) = rig.stop("env1")
    await rig.observe(stopping.meta.id, pb.INSTANCE_STATE_RUNNING)
    await rig.clock.advance(3600)
    await rig.pass_()
    assert rig.view.assignment(stopping.meta.id) is not None


async def test_no_capacity_event_is_published_when_the_shortfall_starts_or_changes_fix_every_pass(rig: Rig):
    await rig.put(pnode("n1", mem=512))
    rel = spec_release("rel1", "env1", mem=256, min_replicas=3)
    await rig.put(rel, spec_env("env1", rel))
    await rig.pass_()
    await rig.pass_()
    await rig.clock.advance(15)
    await rig.pass_()
    await rig.settle_events()
    shortfalls = [e for e in rig.events if e.kind == "schedule.no_capacity"]
    assert [e.message for e in shortfalls] == [
        "placement: only 2 of 3 replicas placeable for env env1 (constraints/capacity); 1 node: 1 filtered by memory"
    ]
    assert shortfalls[0].severity == "warning" and shortfalls[0].environment_id == "env1"
    assert dict(shortfalls[0].fields) == {"filtered_by_memory": "1"}
    await rig.put(spec_env("env1", rel, min_replicas=4))
    await rig.pass_()
    await rig.settle_events()
    assert [e.message for e in rig.events if e.kind == "schedule.no_capacity"][-1] == (
        "placement: only 0 of 2 replicas placeable for env env1 (constraints/capacity); 1 node: 1 filtered by memory"
    )


async def test_other_envs_capacity_use_in_the_same_pass_is_seen(rig: Rig):
    await rig.put(pnode("n1", mem=1024), pnode("n2", mem=1024))
    rel_a = spec_release("relA", "envA", mem=512, min_replicas=3)
    rel_b = spec_release("relB", "envB", mem=512, min_replicas=2)
    await rig.put(rel_a, rel_b, spec_env("envA", rel_a), spec_env("envB", rel_b))
    await rig.pass_()
    assert rig.run_nodes("envA") == ["n1", "n1", "n2"] and rig.run_nodes("envB") == ["n2"]


async def test_replicas_on_other_draining_nodes_do_not_count_as_replacements_fix_loose_readiness(rig: Rig):
    """Reference: n2's HEALTHY replica counted as n1's replacement although n2 is draining too."""
    await rig.put(unlimited("n1"), unlimited("n2"), unlimited("n3"))
    await add_env_release(rig, 1)
    await rig.put(
        assignment("n1", "env1", "rel1", assignment_id="a"),
        assignment("n2", "env1", "rel1", assignment_id="b"),
    )
    for aid in ("a", "b"):
        await rig.observe(aid, pb.INSTANCE_STATE_HEALTHY)
    for node_id in ("n1", "n2"):
        await rig.set_node(node_id, pb.NODE_STATUS_DRAINING, schedulable=False)
    await rig.pass_()
    assert rig.view.assignment("a").desired == RUN and rig.view.assignment("b").desired == RUN
    (replacement,) = [a for a in rig.run("env1") if a.node_id == "n3"]
    await rig.observe(replacement.meta.id, pb.INSTANCE_STATE_HEALTHY)
    await rig.pass_()
    assert rig.view.assignment("a").desired == STOP and rig.view.assignment("b").desired == STOP
