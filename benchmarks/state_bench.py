"""State layer figures: fenced writes, atomic batches, view apply rate and view memory.

Run: ``python -m benchmarks.state_bench [--full]`` (also part of ``make bench``).
One local nats-server, file storage on the real disk, on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time

import psutil
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, embedded_server, print_table, row
from shared import keys as K
from shared.connection import connect
from shared.ids import new_id
from shared.lease import Lease
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer


def _node(i: int) -> pb.Node:
    n = pb.Node(name=f"n{i}", status=pb.NODE_STATUS_ALIVE, schedulable=True)
    n.meta.id = f"n{i:06d}"
    return n


def _assignment(i: int) -> pb.Assignment:
    a = pb.Assignment(
        node_id=f"n{i % 5000:05d}",
        environment_id=f"e{i % 2000:05d}",
        release_id=f"r{i % 2000:05d}",
        project_id="p",
        app_id="a",
        desired=pb.ASSIGNMENT_DESIRED_RUN,
        config_hash="sha256:0123456789abcdef",
    )
    a.meta.id = new_id()
    a.meta.created_at.GetCurrentTime()
    a.meta.updated_at.CopyFrom(a.meta.created_at)
    return a


async def sequential_rate(writer: Writer, count: int) -> float:
    """Single-key writes of one node record per second, one at a time."""
    start = time.perf_counter()
    for _ in range(count):
        await writer.commit(writer.txn().put(_node(0)))
    return count / (time.perf_counter() - start)


async def _writes(url: str, quick: bool) -> list[Row]:
    conn = await connect(url, name="bench")
    await provision(conn.js)
    view = StateView(conn, name="bench")
    await view.start()
    rows: list[Row] = []
    n = 300 if quick else 2000

    # Fenced single-key transition, the non-leader path (CLI, agents): KV update with expected revision.
    plain = Writer(conn, view)
    await plain.commit(plain.txn().create(_node(0)))
    cpu = time.process_time()
    rate = await sequential_rate(plain, n)
    cpu = time.process_time() - cpu
    rows.append(
        row(
            "fenced single-key transitions/s, sequential (expected-revision write)",
            rate,
            "/s",
            ">= 2,000",
            "DESIGN: ~3,200/s sequential KV put",
        )
    )
    rows.append(
        row(
            "client CPU per fenced single-key write, sequential",
            cpu / n * 1e6,
            "µs",
            "",
            "this process: the writer, nats-py, and the view applying its own write",
        )
    )

    lease = Lease(conn, "bench", "bench", ttl=30)
    assert await lease.try_acquire()
    fenced = Writer(conn, view, lease=lease)

    # Leader-fenced single-key transitions one at a time: key + lease fence = an atomic batch of 2.
    rows.append(
        row(
            "leader-fenced single-key transitions/s, sequential",
            await sequential_rate(fenced, 100 if quick else 500),
            "/s",
            ">= 2,000",
            "an atomic batch (key + lease fence): the server's per-batch cost",
        )
    )

    # Leader-fenced single-key transitions: each one carries the lease fence, concurrent callers group commit.
    for i in range(1, 65):
        await plain.commit(plain.txn().create(_node(i)))
    per_caller = max(5, n // 64)

    async def caller(i: int) -> None:
        for _ in range(per_caller):
            await fenced.commit(fenced.txn().put(_node(i)))

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(1, 65)))
    rate = 64 * per_caller / (time.perf_counter() - t0)
    rows.append(row("leader-fenced single-key transitions/s, 64 concurrent (group commit)", rate, "/s", ">= 2,000", ""))

    # Fenced 10-key atomic batches, one at a time: bounded by the server's per-batch disk flush.
    batches = 40 if quick else 200
    base = 1000
    t0 = time.perf_counter()
    for b in range(batches):
        txn = fenced.txn()
        for k in range(10):
            txn.create(_node(base + b * 10 + k))
        await fenced.commit(txn)
    rate = batches / (time.perf_counter() - t0)
    rows.append(
        row(
            "fenced 10-key atomic batches/s, sequential",
            rate,
            "/s",
            ">= 500",
            "DESIGN: 100-280/s (server flush per batch)",
        )
    )

    # Fenced 10-key transactions from concurrent callers (each still all-or-nothing).
    per_caller = 10 if quick else 40
    start_at = 100_000

    async def batch_caller(c: int) -> None:
        for j in range(per_caller):
            txn = fenced.txn()
            for k in range(10):
                txn.create(_node(start_at + (c * per_caller + j) * 10 + k))
            await fenced.commit(txn)

    t0 = time.perf_counter()
    await asyncio.gather(*(batch_caller(c) for c in range(32)))
    rate = 32 * per_caller / (time.perf_counter() - t0)
    rows.append(row("fenced 10-key atomic transactions/s, 32 concurrent (group commit)", rate, "/s", ">= 500", ""))

    await lease.release()
    await view.stop()
    await conn.close()
    return rows


async def _fill(url: str, count: int) -> None:
    conn = await connect(url, name="bench-fill")
    await provision(conn.js)
    view = StateView(conn, name="fill")
    await view.start()
    writer = Writer(conn, view)
    txns = []
    for i in range(0, count, 500):
        txn = writer.txn()
        for j in range(i, min(count, i + 500)):
            txn.create(_assignment(j))
        txns.append(txn)
    results = await writer.commit_many(txns)
    assert all(r is None for r in results), results[:3]
    await view.stop()
    await conn.close()


async def _load_view(url: str) -> dict[str, float]:
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    conn = await connect(url, name="bench-view")
    view = StateView(conn, name="bench")
    t0 = time.perf_counter()
    await view.start(timeout=300)
    elapsed = time.perf_counter() - t0
    gc.collect()
    rss1 = psutil.Process().memory_info().rss
    count = view.count(K.ASSIGNMENT)
    await view.stop()
    await conn.close()
    return {"count": count, "seconds": elapsed, "rss_mb": (rss1 - rss0) / 1e6}


async def _follow_live(url: str, changes: int) -> dict[str, float]:
    """In its own process: a synced view follows ``changes`` new writes; its CPU seconds and wall time."""
    conn = await connect(url, name="bench-live")
    view = StateView(conn, name="live")
    await view.start(timeout=300)
    target = view.last_revision + changes
    print("ready", flush=True)
    me = psutil.Process()
    cpu0 = sum(me.cpu_times()[:2])
    t0 = time.perf_counter()
    assert await view.wait_for_revision(target, timeout=3600)
    elapsed = time.perf_counter() - t0
    cpu = sum(me.cpu_times()[:2]) - cpu0
    await view.stop()
    await conn.close()
    return {"changes": changes, "cpu": cpu, "wall": elapsed}


async def _stream_writes(url: str, changes: int) -> None:
    conn = await connect(url, name="bench-live-writer")
    pending = []
    for i in range(changes):
        a = _assignment(i)
        pending.append(
            conn.js.publish_async("$KV.zattera-state." + K.key_of(a), K.encode(a), stream="KV_zattera-state")
        )
        if len(pending) >= 2000:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    await conn.close()


def _live_apply(url: str, changes: int) -> dict[str, float]:
    """A view in its own process follows a stream of writes from this one: changes per CPU-second of the view
    (its apply capacity on one core) and the wall rate (bounded by the writer here)."""
    follower = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.state_bench", "--follow-live", url, str(changes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout is not None
    assert follower.stdout.readline().strip() == "ready"
    asyncio.run(_stream_writes(url, changes))
    out, _ = follower.communicate(timeout=600)
    return dict(json.loads(out.strip().splitlines()[-1]))


def run(quick: bool = True) -> list[Row]:
    rows: list[Row] = []
    with embedded_server() as server:
        rows += asyncio.run(_writes(server.url, quick))
    with embedded_server() as server:
        count = 100_000
        asyncio.run(_fill(server.url, count))
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.state_bench", "--load-view", server.url],
            capture_output=True,
            text=True,
            check=True,
        )
        loaded = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            row(
                f"view initial load of {int(loaded['count']):,} assignments",
                loaded["count"] / loaded["seconds"],
                "changes/s",
                ">= 20,000",
                "",
            )
        )
        rows.append(row("view memory for 100,000 assignments (RSS growth)", loaded["rss_mb"], "MB", "<= 300", ""))
        live = _live_apply(server.url, 20_000 if quick else 100_000)
        rows.append(
            row(
                "view live apply capacity (changes per CPU-second of the view)",
                live["changes"] / live["cpu"],
                "changes/s",
                ">= 20,000",
                "one core, view in its own process",
            )
        )
        rows.append(
            row(
                "view live apply, wall rate (writer-bound)",
                live["changes"] / live["wall"],
                "changes/s",
                "",
                "writer and view share this 2-core machine",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="larger sample sizes")
    parser.add_argument("--load-view", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--follow-live", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_view:
        print(json.dumps(asyncio.run(_load_view(args.load_view))))
        return
    if args.follow_live:
        url, changes = args.follow_live
        print(json.dumps(asyncio.run(_follow_live(url, int(changes)))))
        return
    print_table("state layer", run(quick=not args.full))


if __name__ == "__main__":
    main()
