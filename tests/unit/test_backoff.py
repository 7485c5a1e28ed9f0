"""Exponential backoff and retrying until stopped (``shared/backoff.py``), on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from shared.backoff import exponential, retry_until_done, retry_until_stopped
from shared.clock import FakeClock
from tests.waiting import eventually


@pytest.mark.parametrize(
    ("first", "attempt", "most", "delay"),
    [
        (1.0, 1, 30.0, 1.0),
        (1.0, 2, 30.0, 2.0),
        (1.0, 5, 30.0, 16.0),
        (1.0, 6, 30.0, 30.0),
        (0.2, 3, 5.0, 0.8),
        (0.2, 10_000, 5.0, 5.0),  # no overflow however long it retries
    ],
)
def test_exponential_backoff_doubles_up_to_its_ceiling(first: float, attempt: int, most: float, delay: float) -> None:
    assert exponential(first, attempt, most) == pytest.approx(delay)


def test_exponential_backoff_counts_attempts_from_one() -> None:
    with pytest.raises(ValueError, match="attempt counts from 1"):
        exponential(1.0, 0, 30.0)


class Flaky:
    """Fails with ``errors`` in turn, then returns "ok"; notes the clock at each attempt."""

    def __init__(self, clock: FakeClock, *errors: Exception) -> None:
        self.clock = clock
        self.errors = list(errors)
        self.attempts: list[float] = []

    async def __call__(self) -> str:
        self.attempts.append(self.clock.now())
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


async def test_retries_with_doubling_delays_until_the_action_succeeds() -> None:
    clock = FakeClock(start=0.0)
    flaky = Flaky(clock, OSError("refused"), OSError("refused"), OSError("refused"))
    task = asyncio.create_task(retry_until_stopped(flaky, asyncio.Event(), what="x", clock=clock))
    for elapsed in (0.2, 0.4, 0.8):
        await eventually(lambda: clock.sleepers == 1, what="backing off")
        await clock.advance(elapsed)
    assert await task == "ok"
    assert flaky.attempts == pytest.approx([0.0, 0.2, 0.6, 1.4])


async def test_stopping_ends_the_wait_at_once() -> None:
    clock = FakeClock(start=0.0)
    stop = asyncio.Event()
    flaky = Flaky(clock, *[OSError("refused")] * 10)
    task = asyncio.create_task(retry_until_stopped(flaky, stop, what="x", clock=clock))
    await eventually(lambda: clock.sleepers == 1, what="backing off")
    stop.set()
    assert await task is None
    assert len(flaky.attempts) == 1


@pytest.mark.parametrize(
    ("error", "retry_on", "never_on"),
    [
        (ValueError("bad"), (OSError,), ()),  # not an error worth retrying
        (ConnectionRefusedError("refused"), (OSError,), (ConnectionRefusedError,)),  # retrying cannot help
    ],
)
async def test_other_errors_are_raised_at_once(
    error: Exception, retry_on: tuple[type[Exception], ...], never_on: tuple[type[Exception], ...]
) -> None:
    flaky = Flaky(FakeClock(), error)
    with pytest.raises(type(error)):
        await retry_until_stopped(flaky, asyncio.Event(), what="x", retry_on=retry_on, never_on=never_on)
    assert len(flaky.attempts) == 1


async def test_without_a_stop_event_it_retries_on_the_clock() -> None:
    clock = FakeClock(start=0.0)
    flaky = Flaky(clock, OSError("refused"))
    task = asyncio.create_task(retry_until_stopped(flaky, None, what="x", first=0.5, clock=clock))
    await eventually(lambda: clock.sleepers == 1, what="backing off")
    await clock.advance(0.5)
    assert await task == "ok"


async def test_retry_until_done_says_whether_the_action_succeeded() -> None:
    clock = FakeClock(start=0.0)
    assert await retry_until_done(Flaky(clock), asyncio.Event(), what="x", clock=clock) is True
    stopped = asyncio.Event()
    stopped.set()
    assert await retry_until_done(Flaky(clock), stopped, what="x", clock=clock) is False
