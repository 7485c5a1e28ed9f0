from __future__ import annotations

import asyncio

from shared.clock import FakeClock


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
