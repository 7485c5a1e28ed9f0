"""Stateful volumes and fencing leases."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from services.scheduler.volumes import LEASE_TTL
from shared.clock import from_timestamp
from shared.placement.placement import place
from shared.volumes import lease_expired, lease_held_by_other
from tests.factories import assignment
from tests.scheduler.builders import deployment, pnode, spec_env, spec_release, unlimited, volume
from tests.scheduler.conftest import Rig

RUN = pb.ASSIGNMENT_DESIRED_RUN
STOP = pb.ASSIGNMENT_DESIRED_STOP


async def stateful_env(rig: Rig, *, volumes: tuple[str, ...] = ("data",), **nodes: pb.Node) -> pb.Release:
    rel = spec_release("rel1", "env1", min_replicas=1, max_replicas=1, stateful=True, volumes=volumes, mem=128)
    await rig.put(*(nodes.values() or (unlimited("n1"), unlimited("n2"))))
    await rig.put(rel, spec_env("env1", rel, project_id="p1"))
    return rel


def only_volume(rig: Rig) -> pb.Volume:
    (vol,) = rig.view.volumes("env1")
    return vol


def expiry(vol: pb.Volume) -> float:
    return from_timestamp(vol.lease.expires_at)


# ---------------------------------------------------------------- §4.9 volumes_test.go


async def test_first_pass_creates_the_volume_and_places_the_replica_on_its_node(rig: Rig):
    await stateful_env(rig)
    await rig.pass_()
    vol = only_volume(rig)
    assert (vol.name, vol.status, vol.node_id, vol.project_id) == ("data", pb.VOLUME_STATUS_ACTIVE, "n1", "p1")
    assert rig.run_nodes("env1") == ["n1"]


async def test_lease_is_acquired_for_the_replica_on_the_volume_node(rig: Rig):
    await stateful_env(rig)
    await rig.pass_()
    vol = only_volume(rig)
    (replica,) = rig.run("env1")
    assert (vol.lease.node_id, vol.lease.assignment_id) == ("n1", replica.meta.id)
    assert expiry(vol) == rig.clock.now() + LEASE_TTL


async def test_lease_is_renewed_only_once_half_its_ttl_is_gone_fix_renewed_every_pass(rig: Rig):
    """Reference: renewed on every pass (15 s later: expiry = new now + 60 s), each write re-triggering it."""
    await stateful_env(rig)
    await rig.pass_()
    first = expiry(only_volume(rig))
    await rig.clock.advance(15)
    await rig.pass_()
    assert expiry(only_volume(rig)) == first
    await rig.clock.advance(16)
    await rig.pass_()
    assert expiry(only_volume(rig)) == rig.clock.now() + LEASE_TTL


async def test_down_node_loses_its_volume_and_lease_but_keeps_its_replica(rig: Rig):
    await stateful_env(rig)
    await rig.pass_()
    before = expiry(only_volume(rig))
    await rig.set_node("n1", pb.NODE_STATUS_DOWN)
    await rig.clock.advance(15)
    await rig.pass_()
    vol = only_volume(rig)
    assert vol.status == pb.VOLUME_STATUS_NODE_LOST and expiry(vol) == before
    assert rig.run_nodes("env1") == ["n1"]
    await rig.clock.advance(60)
    assert lease_expired(only_volume(rig).lease, rig.clock.now())
    kinds = await rig.kinds()
    lost = next(e for e in rig.events if e.kind == "volume.node_lost")
    assert "volume.node_lost" in kinds and lost.environment_id == "env1"
    assert lost.message == 'volume "data" node n1 is down; stateful service stopped until it returns'


async def test_volume_recovers_when_its_node_returns(rig: Rig):
    await stateful_env(rig)
    await rig.pass_()
    await rig.set_node("n1", pb.NODE_STATUS_DOWN)
    await rig.pass_()
    assert only_volume(rig).status == pb.VOLUME_STATUS_NODE_LOST
    await rig.set_node("n1", pb.NODE_STATUS_ALIVE)
    await rig.pass_()
    assert only_volume(rig).status == pb.VOLUME_STATUS_ACTIVE
    await rig.settle_events()
    recovered = next(e for e in rig.events if e.kind == "volume.recovered")
    assert recovered.message == 'volume "data" node n1 recovered' and recovered.severity == "info"


NOW = 1_800_000_000.0


def lease(node_id: str, expires_in: float) -> pb.VolumeLease:
    result = pb.VolumeLease(node_id=node_id, assignment_id="a1")
    result.expires_at.FromNanoseconds(int((NOW + expires_in) * 1e9))
    return result


@pytest.mark.parametrize(
    ("value", "expired"),
    [(lease("n1", 30), False), (lease("n1", -1), True), (None, True), (pb.VolumeLease(node_id="n1"), True)],
    ids=["valid", "past", "absent", "no-expiry"],
)
def test_lease_expired(value, expired):
    assert lease_expired(value, NOW) is expired


@pytest.mark.parametrize(
    ("value", "node_id", "held"),
    [(lease("n1", 30), "n2", True), (lease("n1", 30), "n1", False), (lease("n1", -1), "n2", False)],
    ids=["fresh-other", "fresh-own", "expired-other"],
)
def test_lease_held_by_other(value, node_id, held):
    assert lease_held_by_other(value, node_id, NOW) is held


# ---------------------------------------------------------------- the scheduler's side of §4.7 (stateful deploys)


async def stateful_update_rig(rig: Rig, phase: int) -> None:
    rel1 = spec_release("rel1", "env-d", min_replicas=1, max_replicas=1, stateful=True, volumes=("data",))
    rel2 = spec_release(
        "rel2", "env-d", min_replicas=1, max_replicas=1, stateful=True, volumes=("data",), image="db:v2"
    )
    await rig.put(pnode("n1", cpu=1000, mem=4096), pnode("n2", cpu=1000, mem=4096), rel1, rel2)
    await rig.put(
        spec_env("env-d", rel1, project_id="p1", app_id="a1"),
        volume("vol-data", "env-d", "data", "n1"),
        assignment("n1", "env-d", "rel1", assignment_id="blue-0"),
        deployment("dep1", "env-d", "rel2", "rel1", phase),
    )


async def test_stateful_update_in_progress_is_left_to_the_orchestrator(rig: Rig):
    await stateful_update_rig(rig, pb.DEPLOYMENT_PHASE_STOPPING_OLD)
    blue = rig.view.assignment("blue-0")
    stopping = pb.Assignment()
    stopping.CopyFrom(blue)
    stopping.desired = STOP
    await rig.put(stopping)
    await rig.pass_()
    assert rig.run("env-d") == [] and rig.view.volumes("env-d")[0].node_id == "n1"


async def test_green_of_a_stateful_update_is_placed_on_the_volume_node(rig: Rig):
    await stateful_update_rig(rig, pb.DEPLOYMENT_PHASE_STARTING)
    await rig.put(pnode("n2", cpu=1000, mem=8192))  # more free memory, but not where the data is
    assert place(rig.view, rig.view.release("rel2"), "env-d", 1) == (["n1"], None)


async def test_first_stateful_deploy_places_freely_on_the_lowest_id_node(rig: Rig):
    await stateful_update_rig(rig, pb.DEPLOYMENT_PHASE_STARTING)
    await rig.delete("volume.vol-data", "assignment.n1.blue-0")
    assert place(rig.view, rig.view.release("rel2"), "env-d", 1) == (["n1"], None)


async def test_lease_follows_the_new_instance_after_a_stateful_update(rig: Rig):
    await stateful_update_rig(rig, pb.DEPLOYMENT_PHASE_STARTING)
    await rig.pass_()
    assert only_volume_of(rig, "env-d").lease.assignment_id == "blue-0"
    blue = pb.Assignment()
    blue.CopyFrom(rig.view.assignment("blue-0"))
    blue.desired = STOP
    green = assignment("n1", "env-d", "rel2", assignment_id="green-0")
    green.deployment_id = "dep1"
    await rig.put(blue, green)
    await rig.pass_()
    assert only_volume_of(rig, "env-d").lease.assignment_id == "green-0"


def only_volume_of(rig: Rig, env_id: str) -> pb.Volume:
    (vol,) = rig.view.volumes(env_id)
    return vol


# ---------------------------------------------------------------- fixes


async def test_valid_lease_of_another_node_is_never_stolen(rig: Rig):
    await stateful_env(rig)
    await rig.pass_()
    vol = pb.Volume()
    vol.CopyFrom(only_volume(rig))
    vol.lease.node_id = "n2"
    await rig.put(vol)
    await rig.pass_()
    assert only_volume(rig).lease.node_id == "n2"
    await rig.clock.advance(LEASE_TTL)
    await rig.pass_()
    assert only_volume(rig).lease.node_id == "n1"


async def test_draining_node_volume_is_not_reported_down_fix_misleading_message(rig: Rig):
    """Reference: 'volume "data" node n1 is down; …' for a node the operator is draining."""
    await stateful_env(rig)
    await rig.pass_()
    await rig.set_node("n1", pb.NODE_STATUS_DRAINING, schedulable=False)
    await rig.pass_()
    await rig.settle_events()
    lost = next(e for e in rig.events if e.kind == "volume.node_lost")
    assert lost.message == 'volume "data" node n1 is draining; stateful service stopped until the node is uncordoned'
    assert "is down" not in lost.message


async def test_new_volume_goes_where_the_release_can_run_fix_blind_home(rig: Rig):
    """Reference: the least-used ALIVE node (n1, arm64) although the release is amd64-only."""
    rel = spec_release("rel1", "env1", stateful=True, volumes=("data",), platforms=("linux/amd64",))
    await rig.put(pnode("n1", os_arch="linux/arm64"), pnode("n2", os_arch="linux/amd64"), rel)
    await rig.put(spec_env("env1", rel, project_id="p1"))
    await rig.pass_()
    assert only_volume(rig).node_id == "n2" and rig.run_nodes("env1") == ["n2"]


async def test_volumes_of_one_env_share_a_home(rig: Rig):
    await stateful_env(rig, volumes=("data", "logs"))
    await rig.put(volume("v-other", "other-env", "x", "n1"))  # n1 already hosts a volume
    await rig.pass_()
    assert sorted((v.name, v.node_id) for v in rig.view.volumes("env1")) == [("data", "n2"), ("logs", "n2")]
    assert rig.run_nodes("env1") == ["n2"]


async def test_volume_without_a_home_is_announced_once_fix_every_pass(rig: Rig):
    await stateful_env(rig, n1=unlimited("n1", status=pb.NODE_STATUS_DOWN))
    for _ in range(3):
        await rig.pass_()
    await rig.settle_events()
    homeless = [e.message for e in rig.events if e.kind == "volume.no_capacity"]
    assert homeless == ['no schedulable node for volume "data"']
    assert rig.view.volumes("env1") == []


# ---------------------------------------------------------------- a volume being restored


async def restoring(rig: Rig, vol: pb.Volume) -> None:
    changed = pb.Volume()
    changed.CopyFrom(vol)
    changed.status = pb.VOLUME_STATUS_RESTORING
    await rig.put(changed)


async def test_lease_is_not_renewed_while_the_volume_is_restoring(rig: Rig):
    """Before: the renewal ignored RESTORING, so the replica kept (or got) its lease during the restore."""
    await stateful_env(rig)
    await rig.pass_()
    granted = expiry(only_volume(rig))
    await restoring(rig, only_volume(rig))
    await rig.clock.advance(LEASE_TTL / 2 + 1)  # renewal due
    await rig.pass_()
    assert expiry(only_volume(rig)) == granted
    await rig.clock.advance(LEASE_TTL)
    await rig.pass_()
    vol = only_volume(rig)
    assert vol.status == pb.VOLUME_STATUS_RESTORING and lease_expired(vol.lease, rig.clock.now())


async def test_no_replica_is_placed_or_leased_on_a_restoring_volume_until_the_restore_ends(rig: Rig):
    """Before: the scheduler placed the env's replica on the volume's node and leased it mid-restore."""
    await stateful_env(rig)
    await rig.put(volume("v1", "env1", "data", "n1", status=pb.VOLUME_STATUS_RESTORING))
    await rig.pass_()
    await rig.pass_()
    assert rig.run("env1") == []
    assert not only_volume(rig).HasField("lease")
    ended = pb.Volume()
    ended.CopyFrom(only_volume(rig))
    ended.status = pb.VOLUME_STATUS_ACTIVE
    await rig.put(ended)
    await rig.pass_()
    (replica,) = rig.run("env1")
    vol = only_volume(rig)
    assert replica.node_id == "n1" and (vol.lease.node_id, vol.lease.assignment_id) == ("n1", replica.meta.id)
