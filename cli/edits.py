"""Committing an operator's edit of one record, decided on the current view."""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import Message

from cli.client import Control, fail
from shared.clock import RealClock
from shared.retry import Attempt, RetriesExhausted, commit_with_retry


async def commit_edit(c: Control, what: str, edit: Callable[[], Message | None]) -> Message | None:
    """Commit ``edit()`` — a record decided on the current view, None when there is nothing to write — and
    decide again when a concurrent write won (the scheduler renews leases and heartbeats land meanwhile).
    Returns what was written."""

    def attempt() -> Attempt[Message | None]:
        edited = edit()
        return Attempt(None if edited is None else c.writer.txn().put(edited), edited)

    try:
        return await commit_with_retry(c.writer, attempt, clock=RealClock(), contended=what)
    except RetriesExhausted as exc:
        raise fail(str(exc)) from None
