"""Volume snapshots, node side: deterministic tar → FastCDC chunks → SHA-256 names → zstd → optional
AES-256-GCM, stored in the ``zattera-snapshots`` object store with dedup across all volumes; restore
and a grace-period GC; and :func:`serve_snapshot_requests`, the agent's NATS handler. The control side
(records, dispatch to the volume's node, restore guards) is ``shared.snapshots.dispatch``: the scheduler,
the CLI and the web console drive snapshots through it.
"""

from shared.snapshots.agent import SnapshotAgent, serve_snapshot_requests, volume_dir
from shared.snapshots.chunking import ChunkParams
from shared.snapshots.crypto import Sealer, SealError
from shared.snapshots.engine import PruneResult, SnapshotEngine, SnapshotError, SnapshotResult
from shared.snapshots.manifest import ChunkRef, Manifest
from shared.snapshots.store import SnapshotStore

__all__ = [
    "ChunkParams",
    "ChunkRef",
    "Manifest",
    "PruneResult",
    "SealError",
    "Sealer",
    "SnapshotAgent",
    "SnapshotEngine",
    "SnapshotError",
    "SnapshotResult",
    "SnapshotStore",
    "serve_snapshot_requests",
    "volume_dir",
]
