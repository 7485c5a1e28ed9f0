"""Coalesced change notifications: what a loop waits on instead of polling (the state store, the live view)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Protocol

Change = tuple[str, str]
"""(kind, id) of a changed object."""


class FeedOwner(Protocol):
    """What hands out change feeds: it offers every change to each feed of ``_feeds``."""

    _feeds: set[ChangeFeed]


class ChangeFeed:
    """Coalesced change notifications for a set of kinds (empty set = every kind)."""

    def __init__(self, owner: FeedOwner, kinds: Iterable[str]) -> None:
        self._owner = owner
        self.kinds = frozenset(kinds)
        self._pending: set[Change] = set()
        self._signal = asyncio.Event()

    def _offer(self, kind: str, ident: str) -> None:
        if not self.kinds or kind in self.kinds:
            self._pending.add((kind, ident))
            self._signal.set()

    def poke(self) -> None:
        """Wake the consumer without a change (a resync or an explicit nudge)."""
        self._signal.set()

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def discard(self, changes: Iterable[Change]) -> None:
        """Forget pending changes (a loop's own writes that must not wake it again)."""
        before = len(self._pending)
        self._pending.difference_update(changes)
        if before and not self._pending:
            self._signal.clear()

    def drain(self) -> set[Change]:
        pending, self._pending = self._pending, set()
        self._signal.clear()
        return pending

    async def wait(self, timeout: float | None = None) -> set[Change]:
        """Wait for at least one change (or ``timeout``), then return and clear the pending set."""
        if not self._signal.is_set():
            if timeout is None:
                await self._signal.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._signal.wait(), timeout)
        return self.drain()

    def close(self) -> None:
        self._owner._feeds.discard(self)
