"""Exponential backoff (``shared/backoff.py``)."""

from __future__ import annotations

import pytest

from shared.backoff import Backoff, exponential


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


def test_the_iterator_doubles_to_its_ceiling_and_starts_again_after_a_reset() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [next(backoff) for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    backoff.reset()
    assert next(backoff) == pytest.approx(0.1)
    assert [delay for _, delay in zip(range(3), Backoff(1.0, 30.0), strict=False)] == [1.0, 2.0, 4.0]
