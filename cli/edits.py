"""Committing an operator's edit of one record, decided on the current view."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from google.protobuf.message import Message

from cli.client import Control, fail
from shared.txn import Conflict


async def commit_edit(c: Control, what: str, edit: Callable[[], Message | None]) -> Message | None:
    """Commit ``edit()`` — a record decided on the current view, None when there is nothing to write — and
    decide again when a concurrent write won (the scheduler renews leases and heartbeats land meanwhile).
    Returns what was written."""
    for _ in range(10):
        edited = edit()
        if edited is None:
            return None
        try:
            await c.writer.commit(c.writer.txn().put(edited))
            return edited
        except Conflict:
            await asyncio.sleep(0.05)
    raise fail(f"{what} kept changing; try again")
