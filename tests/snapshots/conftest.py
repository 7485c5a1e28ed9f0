"""Fixtures of the snapshot suite: a fake clock at the reference's epoch, volumes and records in the
state bucket, a node agent serving snapshot requests on real NATS, small chunk sizes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.chunking import TEST_PARAMS
from services.agent.snapshots.handlers import SnapshotAgent
from shared.clock import FakeClock
from shared.connection import Connection
from shared.ids import new_id

BASE = 1_893_456_000.0  # 2030-01-01T00:00:00Z, the reference tests' fake clock start
FILE_MTIME = 1_700_000_000
KEY = bytes(i * 7 % 256 for i in range(32))


def stamp(ts: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(ts * 1e9))
    return t


def snap_volume(
    volume_id: str, schedule: str = "", keep_last: int = 7, created_at: float = BASE, *, node_id: str = "n1"
) -> pb.Volume:
    v = pb.Volume(project_id="p1", environment_id="e1", name="data", node_id=node_id)
    v.status = pb.VOLUME_STATUS_ACTIVE
    v.meta.id = volume_id
    v.meta.created_at.CopyFrom(stamp(created_at))
    v.snapshot_policy.schedule = schedule
    v.snapshot_policy.keep_last = keep_last
    return v


def snapshot_record(
    volume_id: str, created_at: float, status: int = pb.SNAPSHOT_STATUS_COMPLETE, *, snapshot_id: str = ""
) -> pb.VolumeSnapshot:
    s = pb.VolumeSnapshot(volume_id=volume_id, status=status)  # type: ignore[arg-type]
    s.meta.id = snapshot_id or new_id()
    s.meta.created_at.CopyFrom(stamp(created_at))
    s.manifest_key = s.meta.id
    return s


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for path in [root, *root.rglob("*")]:
        os.utime(path, (FILE_MTIME, FILE_MTIME), follow_symlinks=False)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(BASE)


@pytest.fixture
async def agent(conn: Connection, tmp_path: Path) -> AsyncIterator[SnapshotAgent]:
    a = SnapshotAgent(conn, "n1", tmp_path / "volumes", params=TEST_PARAMS, heartbeat=0.2)
    await a.start()
    try:
        yield a
    finally:
        await a.stop()
