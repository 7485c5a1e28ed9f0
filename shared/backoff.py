"""Exponential backoff: the delay before the n-th retry (the agent's restarts, certificate orders, the
scheduler's replacements, the process shell's waits on the cluster)."""

from __future__ import annotations


def exponential(first: float, attempt: int, most: float) -> float:
    """``first · 2^(attempt-1)`` seconds, at most ``most``: ``first`` before the first retry (attempt 1)."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return min(first * 2.0 ** min(attempt - 1, 64), most)
