from __future__ import annotations

import asyncio

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from shared.clock import (
    FakeClock,
    RealClock,
    from_timestamp,
    parse_instant,
    stamp,
    ticker,
    to_timestamp,
    wait_or_timer,
)
from tests.waiting import eventually


async def test_fake_clock_does_not_move_by_itself():
    clock = FakeClock(start=100.0)
    await asyncio.sleep(0)
    assert clock.now() == 100.0


async def test_sleepers_wake_in_deadline_order_when_time_is_advanced():
    clock = FakeClock(start=0.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("c", 30), ("a", 10), ("b", 20))]
    await asyncio.sleep(0)
    assert clock.sleepers == 3
    await clock.advance(15)
    assert woke == [("a", 10.0)]
    assert clock.now() == 15.0
    await clock.advance(15)
    assert woke == [("a", 10.0), ("b", 20.0), ("c", 30.0)]
    await asyncio.gather(*tasks)


async def test_sleep_not_reached_stays_parked():
    clock = FakeClock(start=0.0)
    task = asyncio.create_task(clock.sleep(5))
    await asyncio.sleep(0)
    await clock.advance(4.999)
    assert not task.done()
    await clock.advance(0.001)
    assert task.done()


async def test_cancelled_sleeper_is_skipped():
    clock = FakeClock(start=0.0)
    task = asyncio.create_task(clock.sleep(5))
    await asyncio.sleep(0)
    task.cancel()
    await clock.advance(10)
    assert clock.now() == 10.0
    assert task.cancelled()


async def test_timer_completes_at_its_deadline_and_can_be_cancelled():
    clock = FakeClock()
    fires, cancelled = clock.timer(5), clock.timer(5)
    cancelled.cancel()
    await clock.advance(4.9)
    assert not fires.done()
    await clock.advance(0.1)
    assert fires.done() and fires.result() is None
    assert cancelled.cancelled()
    assert clock.timer(0).done()


async def test_real_timer_fires_and_a_cancelled_one_never_does():
    clock = RealClock()
    fires, cancelled = clock.timer(0.01), clock.timer(0.01)
    cancelled.cancel()
    await asyncio.wait_for(fires, 5)
    assert cancelled.cancelled()


async def test_ticker_keeps_a_fixed_rate_and_skips_ticks_missed_by_a_slow_consumer():
    clock = FakeClock()
    start = clock.now()
    ticks: list[float] = []

    async def consume() -> None:
        async for now in ticker(clock, 10):
            ticks.append(now - start)
            if len(ticks) == 2:
                await clock.sleep(25)  # busy through the ticks at 30 and 40

    task = asyncio.create_task(consume())
    await eventually(lambda: clock.sleepers == 1, what="the ticker waiting for its first tick")
    for _ in range(8):
        await clock.advance(5)
    await clock.advance(20)
    task.cancel()
    # The ticks of 30 and 40 fell while it was busy: one is delivered late (45), then back on the grid.
    assert ticks == [10, 20, 45, 50, 60]


async def test_ticker_refuses_a_non_positive_interval():
    with pytest.raises(ValueError, match="interval"):
        await anext(ticker(FakeClock(), 0))


@pytest.mark.parametrize("epoch", [0.0, 1.001, 1.000000003, 1_764_000_000.123456789, 1_764_000_000.5, 2.0 - 1e-9])
def test_timestamps_round_trip_to_the_nearest_nanosecond(epoch: float) -> None:
    ts = to_timestamp(epoch)
    assert ts.ToNanoseconds() == round(epoch * 1e9)  # int() would give 1000999999 for 1.001
    assert from_timestamp(ts) == pytest.approx(epoch, abs=1e-9)
    assert stamp(Timestamp(), epoch) == ts


async def test_wait_or_timer_returns_when_the_awaitable_finishes_first():
    clock = FakeClock(start=0.0)
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_or_timer(clock, event.wait(), 10.0))
    await asyncio.sleep(0)
    event.set()
    assert await waiting is True
    assert clock.sleepers == 0  # the timer was cancelled


async def test_wait_or_timer_returns_when_the_clock_reaches_the_timeout():
    clock = FakeClock(start=0.0)
    waiting = asyncio.create_task(wait_or_timer(clock, asyncio.Event().wait(), 10.0))
    await asyncio.sleep(0)
    assert clock.sleepers == 1
    await clock.advance(9.9)
    assert not waiting.done()
    await clock.advance(0.1)
    assert await waiting is False


async def test_wait_or_timer_without_a_timeout_waits_for_the_awaitable_only():
    clock = FakeClock(start=0.0)
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_or_timer(clock, event.wait(), None))
    await clock.advance(3600)
    assert not waiting.done()
    event.set()
    assert await waiting is True


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("1764694800", 1764694800.0),
        (" 1764694800.5 ", 1764694800.5),
        ("2025-12-02T17:00:00Z", 1764694800.0),
        ("2025-12-02 17:00:00", 1764694800.0),
        ("2025-12-02T18:00:00+01:00", 1764694800.0),
    ],
)
def test_parse_instant_reads_epoch_seconds_and_iso_8601_with_utc_by_default(text: str, epoch: float) -> None:
    assert parse_instant(text) == epoch


def test_parse_instant_names_what_is_not_a_time() -> None:
    with pytest.raises(ValueError, match="'soon' is not a time"):
        parse_instant("soon")
