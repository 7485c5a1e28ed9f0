"""Stateful volumes: auto-create, NODE_LOST / recovered, and the fencing leases.

**Volumes** (first step of a pass, so pins resolve before placement): a stateful active release's
missing volume is created on a home node; a volume whose node is not ALIVE goes NODE_LOST (its
service stays stopped by design: data cannot follow), and back to ACTIVE when the node returns.

**Leases** (after placement, so a replica placed in this pass is leased at once): the lowest-id RUN
replica on the volume's node holds ``Volume.lease`` = {node, assignment, expires_at = now + 60 s}. A
lease still valid for another node is never stolen; a down node's lease is left to lapse. The agent
starts a stateful container only under a valid lease naming its node (the orchestrator's stateful path
reads the same fields), so two nodes never write the same volume.

Also:

* renewal only once half the TTL is gone (or the holder changed), and the renewal does not wake the
  loop again (a lease rewritten on every pass would re-trigger the pass: a hot loop);
* a DRAINING or DRAINED node's volume is reported as such, not "node is down";
* a new volume's home must be able to run the release (arch, labels, role, capacity), and an env's
  volumes share one home, so Place's pin can always be honoured and the service is never stranded;
* ``volume.no_capacity`` is published when the condition starts or changes (see ``Notices``);
* a RESTORING volume belongs to the restore in progress and is not touched: no status change and no
  lease (neither granted nor renewed), so no replica can start while its directory is being replaced;
  convergence places no new replica of its env meanwhile (``convergence.evaluate_env``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from services.scheduler.decisions import volume_event
from shared.clock import from_timestamp, stamp
from shared.decision import Decision
from shared.deployments import env_ownership
from shared.events import INFO, WARNING
from shared.placement.placement import volume_pin
from shared.placement.platforms import supports
from shared.placement.replicas import RUN, node_is_down
from shared.records import new_meta
from shared.state.reader import StateReader
from shared.state.tables import reservation
from shared.volumes import find_volume, lease_expired, lease_held_by_other, lease_of

LEASE_TTL = 60.0
RENEW_AT = LEASE_TTL / 2
"""A lease is renewed once no more than this much of it is left (with the 15 s tick: every 30 s)."""

_DRAIN_STATES = {pb.NODE_STATUS_DRAINING: "draining", pb.NODE_STATUS_DRAINED: "drained"}


@dataclass
class VolumeDecision:
    writes: list[Decision] = field(default_factory=list)
    homeless: dict[tuple[str, str], str | None] = field(default_factory=dict)
    """(env id, volume name) → the ``volume.no_capacity`` message, or None once it has a home."""


def _home(view: StateReader, env: pb.Environment, release: pb.Release, volume_counts: Counter[str]) -> str:
    """Where a new volume of ``env`` goes ("" = nowhere): the node holding its other volumes, else the
    eligible node hosting the fewest volumes (all projects), lowest id on ties."""
    pin, _ = volume_pin(view, release, env.meta.id)
    if pin:
        return pin
    need_cpu, need_mem = reservation(release)
    constraints = release.service.placement_constraints
    best = ""
    for node in view.nodes():
        if node.status != pb.NODE_STATUS_ALIVE or not node.schedulable or pb.NODE_ROLE_WORKER not in node.roles:
            continue
        if not supports(node.os_arch, release.platforms):
            continue
        if any(node.labels.get(k, "") != v for k, v in constraints.items()):
            continue
        cpu, mem = view.reserved(node.meta.id)
        cap = node.capacity
        if (cap.cpu_millis and cpu + need_cpu > cap.cpu_millis) or (cap.memory_mb and mem + need_mem > cap.memory_mb):
            continue
        if not best or volume_counts[node.meta.id] < volume_counts[best]:
            best = node.meta.id
    return best


def _status_change(view: StateReader, volume: pb.Volume, now: float) -> tuple[pb.Volume, pb.Event] | None:
    if volume.status == pb.VOLUME_STATUS_RESTORING or not volume.node_id:
        return None
    node = view.node(volume.node_id)
    changed = pb.Volume()
    changed.CopyFrom(volume)
    stamp(changed.meta.updated_at, now)
    if node is not None and node.status == pb.NODE_STATUS_ALIVE:
        if volume.status != pb.VOLUME_STATUS_NODE_LOST:
            return None
        changed.status = pb.VOLUME_STATUS_ACTIVE
        message = f'volume "{volume.name}" node {volume.node_id} recovered'
        kind, severity = "volume.recovered", INFO
    else:
        if volume.status == pb.VOLUME_STATUS_NODE_LOST:
            return None
        changed.status = pb.VOLUME_STATUS_NODE_LOST
        drain_state = _DRAIN_STATES.get(node.status) if node is not None else None
        if drain_state:
            message = (
                f'volume "{volume.name}" node {volume.node_id} is {drain_state}; '
                "stateful service stopped until the node is uncordoned"
            )
        else:
            message = f'volume "{volume.name}" node {volume.node_id} is down; stateful service stopped until it returns'
        kind, severity = "volume.node_lost", WARNING
    return changed, volume_event(view, volume, kind, message, now, severity=severity)


def evaluate_volumes(view: StateReader, now: float) -> VolumeDecision:
    """Create missing volumes of stateful active releases; track each volume's node (one write per env)."""
    decision = VolumeDecision()
    per_env: dict[str, Decision] = {}

    def writes_for(env_id: str) -> Decision:
        if env_id not in per_env:
            per_env[env_id] = Decision(f"volumes:{env_id}")
        return per_env[env_id]

    volume_counts: Counter[str] = Counter(v.node_id for v in view.volumes() if v.node_id)
    for env in view.envs():
        release = view.release(env.active_release_id) if env.active_release_id else None
        if release is None or not release.service.stateful or not release.service.volumes:
            continue
        if not env_ownership(view, env.meta.id).scheduler_manages:
            continue  # a deployment under way creates its own volumes
        planned: str = ""
        for mount in release.service.volumes:
            name = mount.volume_name
            if find_volume(view, env.project_id, env.meta.id, name) is not None:
                decision.homeless[(env.meta.id, name)] = None
                continue
            home = planned or _home(view, env, release, volume_counts)
            if not home:
                decision.homeless[(env.meta.id, name)] = f'no schedulable node for volume "{name}"'
                continue
            decision.homeless[(env.meta.id, name)] = None
            planned = home
            volume_counts[home] += 1
            created = pb.Volume(
                project_id=env.project_id,
                environment_id=env.meta.id,
                name=name,
                node_id=home,
                status=pb.VOLUME_STATUS_ACTIVE,
            )
            new_meta(created.meta, now)
            writes_for(env.meta.id).creates.append(created)

    for volume in view.volumes():
        change = _status_change(view, volume, now)
        if change is not None:
            writes = writes_for(volume.environment_id)
            writes.puts.append(change[0])
            writes.events.append(change[1])
    decision.writes = list(per_env.values())
    return decision


def _needs_renewal(lease: pb.VolumeLease | None, node_id: str, holder_id: str, now: float) -> bool:
    if lease is None or lease_expired(lease, now):
        return True
    if lease.node_id != node_id or lease.assignment_id != holder_id:
        return True
    return from_timestamp(lease.expires_at) - now <= RENEW_AT


def evaluate_leases(view: StateReader, now: float) -> dict[str, Decision]:
    """Acquire or renew each volume's fencing lease for the replica on its node: one write per volume id."""
    result: dict[str, Decision] = {}
    for volume in view.volumes():
        if volume.status == pb.VOLUME_STATUS_RESTORING:
            continue  # the restore owns it: no replica may mount it until the restore ends
        if not volume.node_id or node_is_down(view, volume.node_id):
            continue  # let it lapse
        holder = next(
            (
                a
                for a in view.assignments(volume.environment_id)
                if a.desired == RUN and not a.job_id and a.node_id == volume.node_id
            ),
            None,
        )
        if holder is None:
            continue
        lease = lease_of(volume)
        if lease_held_by_other(lease, volume.node_id, now):
            continue
        if not _needs_renewal(lease, volume.node_id, holder.meta.id, now):
            continue
        renewed = pb.Volume()
        renewed.CopyFrom(volume)
        renewed.lease.node_id = volume.node_id
        renewed.lease.assignment_id = holder.meta.id
        stamp(renewed.lease.expires_at, now + LEASE_TTL)
        result[volume.meta.id] = Decision(f"lease:{volume.meta.id}", puts=[renewed])
    return result
