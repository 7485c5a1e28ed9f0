"""What the snapshot dispatcher refuses with and checks before it acts: its typed refusals (busy, record not
written, restore refused, key mismatch, node failed), the cluster's snapshot key target
(``snapshot_target``) and its fingerprint, whether a volume is mounted and by which assignment."""

from __future__ import annotations

import hashlib

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.actions.refusals import Conflicting, Unavailable
from shared.settings import Settings, settings
from shared.state.reader import StateReader
from shared.volumes import lease_expired, lease_of

SNAPSHOT_KEY_ENV = "ZATTERA_SNAPSHOT_KEY"  # hex of the optional 32-byte AES-256-GCM cluster key


class SnapshotBusy(Conflicting):
    """A snapshot (or restore) of this volume is already running."""


class RecordNotWritten(Conflicting):
    """The RUNNING record could not be written: nothing was dispatched."""


class RestoreRefused(Conflicting):
    """The volume or the snapshot is not in a state to restore (mounted, restoring, not COMPLETE)."""


class NodeOperationFailed(Unavailable):
    """The volume's node did not do it: no agent answering, silent too long, or it reported an error."""


class SnapshotKeyMismatch(RestoreRefused):
    """The store's snapshots are sealed with another key (or none) than this process's: refused, because
    chunks are shared by every snapshot and a mixed store cannot be restored or garbage-collected."""


def key_fingerprint(target: cpb.SnapshotTarget) -> str:
    """What ``VolumeSnapshot.key_fingerprint`` records for snapshots taken with ``target``."""
    return hashlib.sha256(target.data_key).hexdigest()[:16] if target.data_key else ""


def describe_key(fingerprint: str) -> str:
    return f"the key {fingerprint}" if fingerprint else "no key"


def snapshot_target(cfg: Settings | None = None) -> cpb.SnapshotTarget:
    """The snapshot key of this process's settings (``ZATTERA_SNAPSHOT_KEY``), as the agents receive it."""
    key = (cfg or settings()).snapshot_key.get_secret_value()
    return cpb.SnapshotTarget(data_key=bytes.fromhex(key) if key else b"")


def volume_mounted(view: StateReader, volume: pb.Volume, now: float) -> bool:
    """Mounted = its fencing lease is unexpired, or a non-job RUN assignment of its environment sits on
    its node (the instance holding the data may be up even while the lease lapses)."""
    if not lease_expired(lease_of(volume), now):
        return True
    return any(
        a.environment_id == volume.environment_id and not a.job_id and a.desired == pb.ASSIGNMENT_DESIRED_RUN
        for a in view.assignments_by_node(volume.node_id)
    )


def holder_assignment(view: StateReader, volume: pb.Volume) -> str:
    """The instance a pre-hook runs in: the lease holder, else the env's lowest-id RUN assignment there."""
    if volume.HasField("lease") and volume.lease.assignment_id:
        return volume.lease.assignment_id
    for a in view.assignments_by_node(volume.node_id):
        if a.environment_id == volume.environment_id and not a.job_id and a.desired == pb.ASSIGNMENT_DESIRED_RUN:
            return a.meta.id
    return ""
