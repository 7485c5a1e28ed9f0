"""Shared/exclusive lock: snapshots and restores share it, a prune (GC) holds it alone.

Writer-preferring: once a prune waits, new snapshots queue behind it, so a steady stream of snapshots
cannot starve garbage collection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class SharedExclusiveLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._sharers = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @property
    def sharers(self) -> int:
        return self._sharers

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._sharers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._sharers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._exclusive_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._sharers)
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()
