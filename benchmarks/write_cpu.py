"""Client CPU per sequential fenced single-key write, for comparing trees one figure at a time.

Runs the loop of ``benchmarks.state_bench``'s row "client CPU per fenced single-key write, sequential" alone:
``Writer.commit`` of one node record, 200 writes to warm up, then N measured, on a nats-server of its own. It
measures the tree on ``PYTHONPATH``, so one copy of it compares several trees (alternate them):

    PYTHONPATH=<tree>:<tree>/proto python benchmarks/write_cpu.py 2000

Prints ``<µs of this process's CPU per write> <writes per second>``. Trees from before ``shared/natsio.py`` was
split are read too.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.state_bench import _node, sequential_rate
from shared.embedded import EmbeddedNats
from shared.state.feed import StateView
from shared.txn import Writer

try:
    from shared.connection import connect
    from shared.provisioning import provision
except ImportError:  # a tree before the split of shared/natsio.py
    from shared.natsio import connect, provision  # type: ignore[no-redef]

WARM_UP = 200


async def measure(url: str, count: int) -> tuple[float, float]:
    """(µs of CPU per write, writes per second) over ``count`` sequential writes."""
    conn = await connect(url, name="write-cpu")
    try:
        await provision(conn.js)
        view = StateView(conn, name="write-cpu")
        await view.start()
        writer = Writer(conn, view)
        await writer.commit(writer.txn().create(_node(0)))
        await sequential_rate(writer, WARM_UP)
        cpu = time.process_time()
        rate = await sequential_rate(writer, count)
        return (time.process_time() - cpu) / count * 1e6, rate
    finally:
        await conn.close()


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedNats(data_dir=Path(data)).start()
        try:
            cpu, rate = asyncio.run(measure(server.url, count))
        finally:
            server.stop()
    print(f"{cpu:.1f} {rate:.0f}")


if __name__ == "__main__":
    main()
