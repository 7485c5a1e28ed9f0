"""Exponential backoff, the one formula and the one iterator every retry uses: ``first``, doubling, at most
``most`` (the agent's restarts, certificate orders, the scheduler's replacements, the process shell's waits
on the cluster, re-subscribing views and watches, HAProxy restarts, activations, route fetches)."""

from __future__ import annotations


def exponential(first: float, attempt: int, most: float) -> float:
    """``first · 2^(attempt-1)`` seconds, at most ``most``: ``first`` before the first retry (attempt 1)."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return min(first * 2.0 ** min(attempt - 1, 64), most)


class Backoff:
    """The pauses of a retry loop: ``next(backoff)`` is the pause before the next retry (``first``, then
    doubling up to ``most``); :meth:`reset` after a success starts again from ``first``.

    >>> backoff = Backoff(0.1, 0.5)
    >>> [next(backoff) for _ in range(4)]
    [0.1, 0.2, 0.4, 0.5]
    """

    def __init__(self, first: float, most: float) -> None:
        self.first = first
        self.most = most
        self.failures = 0

    def __iter__(self) -> Backoff:
        return self

    def __next__(self) -> float:
        self.failures += 1
        return exponential(self.first, self.failures, self.most)

    def reset(self) -> None:
        self.failures = 0


def resubscribing() -> Backoff:
    """The pauses of a reader subscribing again after a reconnect or a lost consumer (the state view's
    resync, the live view, watches): 0.1 s doubling to 5 s, so a stream electing its leader is retried
    quickly and a cluster down for long is not hammered."""
    return Backoff(0.1, 5.0)
