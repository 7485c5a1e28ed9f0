"""The services' instruments on real NATS, read in process: a fenced commit counts as a decision of its
loop, a refused one as a commit conflict, a won lease as a term (held while leading), a pass its duration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from shared.connection import Connection
from shared.lease import Leadership, run_while_leading
from shared.metrics import use_in_memory_reader
from shared.state.feed import StateView
from shared.txn import Conflict, Writer
from tests.factories import node
from tests.waiting import eventually

_reader: InMemoryMetricReader | None = None


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    global _reader
    if _reader is None:
        _reader = use_in_memory_reader()
    yield _reader


def points(reader: InMemoryMetricReader, name: str, **labels: str) -> float:
    """The value (sum, or count for a histogram) of ``name``'s points whose labels include ``labels``."""
    data = reader.get_metrics_data()
    total = 0.0
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    if set(labels.items()) <= set((point.attributes or {}).items()):
                        total += getattr(point, "value", None) or getattr(point, "count", 0)
    return total


async def test_decisions_conflicts_and_lease_terms_are_counted_per_loop(
    conn: Connection, view: StateView, reader: InMemoryMetricReader
) -> None:
    decided = points(reader, "zattera.decisions", loop="metrics-test")
    refused = points(reader, "zattera.commit.conflicts", loop="metrics-test")
    terms = points(reader, "zattera.lease.terms", loop="metrics-test")
    leading = asyncio.Event()
    writers: list[Writer] = []

    async def lead(leadership: Leadership) -> None:
        writers.append(Writer(conn, view, lease=leadership.lease))
        leading.set()
        await asyncio.Future()

    task = asyncio.create_task(run_while_leading(conn, "metrics-test", lead, holder="t", ttl=5, renew_interval=1))
    try:
        await asyncio.wait_for(leading.wait(), 10)
        assert points(reader, "zattera.lease.terms", loop="metrics-test") == terms + 1
        assert points(reader, "zattera.lease.held", loop="metrics-test") == 1
        writer = writers[0]
        await writer.commit(writer.txn().create(node("m1")))
        assert points(reader, "zattera.decisions", loop="metrics-test") == decided + 1
        with pytest.raises(Conflict):
            await writer.commit(writer.txn().create(node("m1")))  # exists already: refused, nothing written
        assert points(reader, "zattera.commit.conflicts", loop="metrics-test") == refused + 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await eventually(lambda: points(reader, "zattera.lease.held", loop="metrics-test") == 0, what="lease given up")
