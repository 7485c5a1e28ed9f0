"""Volume snapshot throughput: ``python -m benchmarks.snapshot_bench [--full]``.

A directory of mixed files (incompressible binaries, compressible text, many small files) is snapshotted
into an embedded nats-server whose store is on the real disk, with the cluster key set (the slowest
path: zstd + AES-256-GCM). Figures: first snapshot MB/s, re-snapshot of the unchanged tree (bytes
uploaded, seconds), one byte changed (chunks uploaded), restore MB/s, and the disk's own sequential
read rate in the same run, the physical limit the first snapshot is bounded by. Quick mode uses 256 MiB
and scales the time target; ``--full`` uses 1 GiB.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb

from benchmarks.common import bench_main
from services.agent.snapshots.engine import SnapshotEngine
from shared.connection import connect
from shared.embedded import EmbeddedNats
from shared.provisioning import provision
from shared.snapshots.store import SnapshotStore

GIB = 1 << 30
MB = 1e6
KEY = bytes(range(32))


def make_dataset(root: Path, total: int, seed: int = 1) -> None:
    """~45% random binaries (4–32 MiB), ~40% hex text (compresses ~2x), ~15% small files (4–64 KiB)."""
    rng = random.Random(seed)
    budgets = {"bin": total * 45 // 100, "text": total * 40 // 100, "small": total * 15 // 100}
    for kind, budget in budgets.items():
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        index = 0
        while budget > 0:
            if kind == "bin":
                size = min(budget, rng.randint(4, 32) << 20)
                data = os.urandom(size)
            elif kind == "text":
                size = min(budget, rng.randint(2, 8) << 20)
                data = os.urandom((size + 1) // 2).hex().encode()[:size]
            else:
                size = min(budget, rng.randint(4, 64) << 10)
                data = os.urandom(size)
            (folder / f"{kind}-{index:05d}").write_bytes(data)
            budget -= len(data)
            index += 1


def drop_cache(root: Path) -> None:
    """Evict the dataset's pages (only its own files) so reads come from the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_rate(root: Path) -> float:
    drop_cache(root)
    total, start = 0, time.perf_counter()
    buf = bytearray(4 << 20)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total / MB / (time.perf_counter() - start)


def flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


async def measure(work: Path, size: int) -> list[dict[str, object]]:
    data = work / "volume"
    make_dataset(data, size)
    disk = disk_read_rate(data)
    server = EmbeddedNats(data_dir=work / "nats").start()
    try:
        conn = await connect(server.url, name="snapshot-bench")
        await provision(conn.js)
        engine = SnapshotEngine(await SnapshotStore.open(conn.js, cpb.SnapshotTarget(data_key=KEY)))
        drop_cache(data)
        start = time.perf_counter()
        first = await engine.snapshot(data, "first")
        first_s = time.perf_counter() - start

        start = time.perf_counter()
        unchanged = await engine.snapshot(data, "unchanged")
        unchanged_s = time.perf_counter() - start

        flip_middle_byte(sorted((data / "bin").iterdir())[0])
        one_byte = await engine.snapshot(data, "one-byte")

        start = time.perf_counter()
        restored = await engine.restore("first", work / "restored")
        restore_s = time.perf_counter() - start
        await conn.close()
    finally:
        server.stop()
    scale = size / GIB
    anchor = f"disk sequential read {disk:.0f} MB/s"
    return [
        {"figure": "disk sequential read (physical limit)", "value": round(disk), "unit": "MB/s", "target": "-",
         "anchor": f"{size / MB:.0f} MB dataset, page cache dropped"},
        {"figure": "first snapshot", "value": round(first.tar_bytes / MB / first_s), "unit": "MB/s",
         "target": ">= 100", "anchor": f"{anchor}; {first.chunk_count} chunks, zstd + AES-256-GCM"},
        {"figure": "re-snapshot unchanged: uploaded", "value": unchanged.uploaded_bytes, "unit": "bytes",
         "target": "0", "anchor": f"{unchanged.chunk_count} chunks all deduplicated"},
        {"figure": "re-snapshot unchanged: time", "value": round(unchanged_s, 2), "unit": "s",
         "target": f"<= {3 * scale:.2f} (3 s per GiB)", "anchor": f"{first.tar_bytes / MB / unchanged_s:.0f} MB/s"},
        {"figure": "one byte changed: chunks uploaded", "value": one_byte.new_chunks, "unit": "chunks",
         "target": "<= 2", "anchor": f"{one_byte.uploaded_bytes} bytes uploaded"},
        {"figure": "restore", "value": round(restored / MB / restore_s), "unit": "MB/s", "target": "-",
         "anchor": anchor},
    ]  # fmt: skip


def run(quick: bool = True) -> list[dict[str, object]]:
    size = GIB // 4 if quick else GIB
    work = Path(tempfile.mkdtemp(prefix="zattera-snapshot-bench-", dir=os.environ.get("ZATTERA_BENCH_DIR")))
    try:
        return asyncio.run(measure(work, size))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    bench_main("Volume snapshots", run, __doc__, "1 GiB dataset (default: 256 MiB)")


if __name__ == "__main__":
    main()
