"""Build dispatch benchmark: latency QUEUED → RunBuild received by the builder, and throughput of 1,000
queued builds over 20 instant builders, on an embedded nats-server with the real dispatcher under its lease.

``python -m benchmarks.builds_bench`` (quick, < 60 s) or ``--full`` (more latency samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, percentile, row
from services.builds.dispatcher import BuildDispatcher
from services.builds.planning import BuildDispatcherConfig
from shared import keys as K
from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.ids import new_id
from shared.lease import run_while_leading
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests.builds import seed
from tests.builds.fake_builder import FakeBuilder, instant_success

BUILDERS = 20
THROUGHPUT_BUILDS = 1000


def queued_build() -> pb.Build:
    return seed.build(new_id())


def succeeded(view: StateView, builds: list[pb.Build]) -> bool:
    return all((b := view.build(x.meta.id)) is not None and b.status == pb.BUILD_STATUS_SUCCEEDED for x in builds)


async def until(view: StateView, kind: str, cond: Callable[[], bool]) -> None:
    feed = view.subscribe({kind})
    try:
        while not cond():
            await feed.wait(timeout=1.0)
    finally:
        feed.close()


class Bench:
    def __init__(self, url: str) -> None:
        self.url = url
        self.received: dict[str, float] = {}
        self.arrival = asyncio.Event()
        self.conns: list[Connection] = []
        self.views: list[StateView] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def view(self, name: str) -> tuple[Connection, StateView]:
        conn = await connect(self.url, name=name)
        await provision(conn.js)
        view = StateView(conn, name=name)
        await view.start()
        self.conns.append(conn)
        self.views.append(view)
        return conn, view

    async def start(self) -> Writer:
        admin, creator_view = await self.view("bench-creator")
        builders_conn, _ = await self.view("bench-builders")
        writer = Writer(admin, creator_view)
        txn = writer.txn("builders")
        for i in range(BUILDERS):
            txn.put(seed.builder_node(f"builder-{i:02d}"))
            builder = FakeBuilder(builders_conn, f"builder-{i:02d}", script=instant_success, on_request=self.on_request)
            await builder.start()
        await writer.commit(txn)
        conn, view = await self.view("bench-dispatcher")
        dispatcher = BuildDispatcher(LoopDeps(conn, view, RealClock()), config=BuildDispatcherConfig())
        self.tasks.append(asyncio.create_task(run_while_leading(conn, "builds", dispatcher.run, holder="bench")))
        await until(view, K.LEASE, lambda: view.lease("builds") is not None)
        return writer

    def on_request(self, request: cpb.RunBuildRequest) -> None:
        self.received[request.build.meta.id] = time.perf_counter()
        self.arrival.set()

    async def latency(self, writer: Writer, samples: int) -> list[float]:
        """One build at a time on idle builders: from the QUEUED write to the request at the builder."""
        latencies = []
        for _ in range(samples):
            build = queued_build()
            self.arrival.clear()
            started = time.perf_counter()
            await writer.commit(writer.txn("queue").put(build))
            await self.arrival.wait()
            latencies.append((self.received[build.meta.id] - started) * 1000.0)
            await until(writer.view, K.BUILD, lambda b=build: succeeded(writer.view, [b]))  # type: ignore[misc]
        return latencies

    async def throughput(self, writer: Writer, count: int) -> float:
        builds = [queued_build() for _ in range(count)]
        started = time.perf_counter()
        await writer.commit_many([writer.txn("queue").put(b) for b in builds])
        await until(writer.view, K.BUILD, lambda: succeeded(writer.view, builds))
        return count / (time.perf_counter() - started)

    async def stop(self) -> None:
        for task in self.tasks:
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=0.2)
        for view in self.views:
            await view.stop()
        for conn in self.conns:
            with contextlib.suppress(Exception):
                await conn.close()


async def _run(quick: bool, url: str) -> list[Row]:
    bench = Bench(url)
    try:
        writer = await bench.start()
        await bench.latency(writer, 5)  # warm up
        latencies = await bench.latency(writer, 100 if quick else 1000)
        rate = await bench.throughput(writer, THROUGHPUT_BUILDS)
    finally:
        await bench.stop()
    anchor = "issue 7 / DESIGN §3 (build dispatch)"
    figure = "build dispatch latency QUEUED → RunBuild at the builder"
    return [
        row(f"{figure}, p50", median(latencies), "ms", "", anchor),
        row(f"{figure}, p99", percentile(latencies, 99), "ms", "≤ 100 ms", anchor),
        row(
            f"build throughput, {THROUGHPUT_BUILDS} queued over {BUILDERS} instant builders",
            rate,
            "builds/s",
            "",
            anchor,
        ),
    ]


def run(quick: bool = True) -> list[Row]:
    with embedded_server() as server:
        return asyncio.run(_run(quick, server.url))


def main() -> None:
    bench_main("Build dispatch", run, __doc__, "1,000 latency samples instead of 100")


if __name__ == "__main__":
    main()
