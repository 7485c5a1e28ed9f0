"""Volume fencing leases (``Volume.lease``): who may mount a stateful volume right now; and how many
snapshots a volume's policy keeps.

The scheduler grants and renews the leases, the snapshot dispatcher and the agent check them; one definition
keeps the three in agreement. A RESTORING volume belongs to its restore: no replica is placed on it and no
lease is granted until the restore ends (or the snapshot scheduler's reaper gives up on it).
"""

from __future__ import annotations

from collections.abc import Iterable

from zattera.v1 import types_pb2 as pb

from shared.state.reader import StateReader

DEFAULT_KEEP_LAST = 7
"""COMPLETE snapshots a policy with ``keep_last`` 0 keeps."""


def snapshots_kept(policy: pb.SnapshotPolicy) -> int:
    """The COMPLETE snapshots a volume keeps, in the local store and on its off-site target alike."""
    return policy.keep_last or DEFAULT_KEEP_LAST


def lease_of(volume: pb.Volume) -> pb.VolumeLease | None:
    return volume.lease if volume.HasField("lease") else None


def lease_expired(lease: pb.VolumeLease | None, now: float) -> bool:
    """Expired when absent, naming no node, without an expiry, or ``now >= expires_at``."""
    if lease is None or not lease.node_id or not lease.HasField("expires_at"):
        return True
    return now >= lease.expires_at.seconds + lease.expires_at.nanos / 1e9


def lease_held_by_other(lease: pb.VolumeLease | None, node_id: str, now: float) -> bool:
    """A still-valid lease naming a different node (which must not be stolen)."""
    return lease is not None and not lease_expired(lease, now) and lease.node_id != node_id


def restoring_volume(volumes: Iterable[pb.Volume]) -> pb.Volume | None:
    """The first of ``volumes`` a restore holds (status RESTORING): nothing may place, lease or start on it."""
    return next((v for v in volumes if v.status == pb.VOLUME_STATUS_RESTORING), None)


def find_volume(view: StateReader, project_id: str, env_id: str, name: str) -> pb.Volume | None:
    """The volume named ``name`` of (project, env); the oldest when duplicates exist (how the scheduler
    pins a stateful env and how ``zattera apps apply`` finds a volume's policy target)."""
    for volume in view.volumes(env_id):
        if volume.project_id == project_id and volume.name == name:
            return volume
    return None
