"""A removal asked again gets the answer of its first asking.

``zattera nodes remove`` and ``zattera cluster retire-seats`` send a ``request_id``; the join service that
takes the request records the removal under it in its bucket (``removal.<id>``: running, then the answer), and
runs it once. The asking side sends the same request again every :data:`ASK_EVERY` seconds while no answer
came: an answer lost on its way back (the removal updates the accounts that answer crosses) or still being
worked out is then read from the record, never a second removal.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.errors import ZatteraError

REMOVAL_PREFIX = "removal."
REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
ASK_EVERY = 20.0
"""Seconds the asking side waits for an answer before it sends the same request again."""
POLL = 0.5
"""Seconds between two reads of a record still running (a request asked again while the first runs)."""


def new_request_id() -> str:
    return uuid.uuid4().hex


async def ask_removal(
    nc: NATS, subject: str, request: dict[str, Any], timeout: float, every: float = ASK_EVERY
) -> bytes:
    """The join service's answer to ``request`` (a ``request_id`` added unless it has one), asked again with
    the same id every ``every`` s while none came, until ``timeout``; :class:`TimeoutError` when none came by then,
    nats-py's :class:`NoRespondersError` when no join service listens."""
    body = json.dumps({**request, "request_id": request.get("request_id") or new_request_id()}).encode()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {timeout:.0f} s")
        try:
            msg = await nc.request(subject, body, timeout=min(every, left))
        except TimeoutError:  # nats-py's timeout is one too
            continue
        return bytes(msg.data or b"")


@dataclass
class RecordedAnswers:
    """The answers of removals, by request id, in the join bucket (whose records expire with the bucket's TTL)."""

    kv: KeyValue
    wait: float
    """How long a request asked again waits for the first asking's answer."""
    pause: Callable[[float], Awaitable[None]] = asyncio.sleep
    monotonic: Callable[[], float] = time.monotonic

    async def once(self, request_id: str, run: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``run``'s answer, recorded under ``request_id``; asked again, the recorded answer (``"repeated":
        true``), waited for while the first asking runs. A refusal (:class:`ZatteraError`) is recorded too; a
        NATS failure or a timeout is not: the record goes, so the request asked again runs it again."""
        if not REQUEST_ID.match(request_id):
            raise ZatteraError("request_id: letters, digits, '-' and '_' (8 to 64)")
        key = f"{REMOVAL_PREFIX}{request_id}"
        try:
            await self.kv.create(key, json.dumps({"state": "running"}).encode())
        except (KeyWrongLastSequenceError, BadRequestError):
            return await self._recorded(key)
        try:
            answer = await run()
        except ZatteraError as exc:
            await self._done(key, {"error": str(exc)})
            raise
        except BaseException:
            await asyncio.shield(self._forget(key))
            raise
        await self._done(key, answer)
        return answer

    async def _done(self, key: str, answer: dict[str, Any]) -> None:
        await self.kv.put(key, json.dumps({"state": "done", "answer": answer}).encode())

    async def _forget(self, key: str) -> None:
        try:
            await self.kv.delete(key)
        except (NatsError, TimeoutError):
            pass  # a request asked again then waits for it and gives up after `wait`

    async def _recorded(self, key: str) -> dict[str, Any]:
        deadline = self.monotonic() + self.wait
        while True:
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                entry = None
            record: dict[str, Any] = json.loads(entry.value or b"{}") if entry is not None else {}
            if entry is None or not record:
                raise ZatteraError("the first asking of this removal failed: run the command again")
            if record.get("state") == "done":
                answer: dict[str, Any] = record.get("answer") or {}
                if "error" in answer:
                    raise ZatteraError(str(answer["error"]))
                return {**answer, "repeated": True}
            if self.monotonic() > deadline:
                raise ZatteraError(
                    f"the removal asked first is still running after {self.wait:.0f} s: see zattera nodes list"
                )
            await self.pause(POLL)
