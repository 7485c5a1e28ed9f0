"""The relay of agents' and operators' state-bucket writes (secured clusters, SECURITY.md).

The state stream accepts rollup headers (its ``subject_delete_marker_ttl`` forces ``allow_rollup_hdrs``),
so a publish with ``Nats-Rollup: all`` on one's own key would erase every key. Agents' and operators' writes
therefore do not reach the stream directly: their account's import renames ``$KV.zattera-state.<key>`` to
``zattera.relay.$KV.zattera-state.<key>`` in ``ZATTERA``, where this relay (run by the join service, control
credential) republishes the value with only the headers a key write needs, and returns the stream's answer
(ack or error) unchanged. An agent's ``observed``/``node`` key must be its own node's
(``Nats-Request-Info``), and nobody but the services writes a lease: the permissions already say so, this
checks it once more. A message without caller identity did not come through an import and is refused.

Every operator write it sees — stored, refused by the relay or by the stream — is recorded in the audit log
(:mod:`shared.audit`) with the identity the server set, before the answer goes back to the operator: the relay
is the one place every secured operator write crosses. An atomic batch is one entry (its relayed keys are
remembered until its commit message; a batch whose commit never comes is recorded ``unconfirmed``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import nats
from nats.aio.msg import Msg

from shared.audit import (
    ACTION_HEADER,
    REQUEST_ID_HEADER,
    USER_HEADER,
    AuditEntry,
    AuditLog,
    Auditor,
    KeyWrite,
    claim,
)
from shared.connection import Connection
from shared.ids import new_id
from shared.security.accounts import RELAY_PREFIX
from shared.security.callers import Caller, answerable, caller
from shared.subjects import STATE_PREFIX

log = logging.getLogger(__name__)

RELAYED_HEADERS = frozenset(
    {
        "Nats-Expected-Last-Subject-Sequence",
        "Nats-Msg-Id",
        "Nats-TTL",
        "KV-Operation",
        "Nats-Batch-Id",
        "Nats-Batch-Sequence",
        "Nats-Batch-Commit",
        "traceparent",
        "tracestate",
    }
)
"""What a key write needs: compare-and-set, de-duplication, a tombstone's life, a delete, an atomic batch of
the node's own keys (each message checked here), the trace. Not ``Nats-Rollup``, ``Nats-Expected-Stream``,
``Nats-Expected-Last-Sequence`` nor anything else."""
RELAY_TIMEOUT = 5.0
OWN_NODE_KINDS = ("observed", "node")
WRONG_LAST_SEQUENCE = 10071
BATCH_MEMORY = 30.0
"""How long an operator batch's relayed keys wait for its commit message before being recorded unconfirmed."""
MAX_REMEMBERED_BATCHES = 1000


def _refusal(description: str) -> bytes:
    return json.dumps({"error": {"code": 400, "err_code": 0, "description": description}}).encode()


def relayed_write(
    subject: str, headers: dict[str, str], node: str, *, agent: bool = True
) -> tuple[str, dict[str, str]] | str:
    """The state subject and headers to publish for a relayed message, or why it is refused. ``node``: the
    caller's name; ``agent``: the caller is an agent (its ``observed``/``node`` keys must be its own)."""
    key_subject = subject[len(RELAY_PREFIX) :]
    if not subject.startswith(RELAY_PREFIX) or not key_subject.startswith(STATE_PREFIX):
        return f"not a state key: {subject}"
    tokens = key_subject[len(STATE_PREFIX) :].split(".")
    if tokens[0] == "lease":
        return f"{key_subject}: leases are written by the services only"
    if agent and tokens[0] in OWN_NODE_KINDS and (len(tokens) < 2 or tokens[1] != node):
        return f"{key_subject} is not a key of node {node or '(unknown)'}"
    kept = {name: value for name, value in headers.items() if name in RELAYED_HEADERS}
    if kept.get("KV-Operation", "DEL") != "DEL":
        return f"KV-Operation {kept['KV-Operation']} refused: only DEL"
    return key_subject, kept


def written_key(subject: str, headers: dict[str, str]) -> KeyWrite:
    """The key and operation a relayed message asks for (for the audit log: no value)."""
    key = subject.removeprefix(RELAY_PREFIX).removeprefix(STATE_PREFIX)
    return KeyWrite(key, "delete" if headers.get("KV-Operation") else "put")


def operator_auditor(who: Caller, headers: dict[str, str]) -> Auditor:
    """An operator's identity as the server set it; what the request claims only as claims."""
    return Auditor(
        source="cli",
        user=who.name or who.user,
        verified=True,
        verified_by="nats-credential",
        action=claim(headers.get(ACTION_HEADER, "")),
        action_claimed=True,
        address=who.host,
        request_id=claim(headers.get(REQUEST_ID_HEADER, "")) or new_id(),
        credential={"account": who.account, "user_key": who.user, "issuer_key": who.issuer_key, "name": who.name},
        claimed_user=claim(headers.get(USER_HEADER, "")),
    )


def answer_outcome(data: bytes) -> tuple[str, int]:
    """The audit outcome of the stream's answer to a write, and the stored sequence (0: not stored)."""
    try:
        answer = json.loads(data or b"{}")
    except ValueError:
        return "unconfirmed", 0
    if not isinstance(answer, dict):
        return "unconfirmed", 0
    error = answer.get("error")
    if isinstance(error, dict):
        kind = "conflict" if error.get("err_code") == WRONG_LAST_SEQUENCE else "refused"
        return f"{kind}: {error.get('description', '')} (code {error.get('err_code', 0)})", 0
    return "ok", int(answer.get("seq") or 0)


class BatchKeys:
    """The keys of operators' batches the relay has passed on, until each batch's commit message."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._batches: dict[str, tuple[float, Auditor, list[KeyWrite]]] = {}

    def remember(self, batch_id: str, auditor: Auditor, key: KeyWrite) -> None:
        _, first, keys = self._batches.get(batch_id, (self._now(), auditor, []))
        keys.append(key)
        self._batches[batch_id] = (self._now(), first, keys)

    def take(self, batch_id: str) -> list[KeyWrite]:
        return self._batches.pop(batch_id, (0.0, None, []))[2]

    def stale(self) -> list[AuditEntry]:
        """Batches whose commit did not come (within :data:`BATCH_MEMORY`, or beyond the memory's size)."""
        now = self._now()
        gone = [b for b, (at, _, _) in self._batches.items() if now - at > BATCH_MEMORY]
        overflow = max(0, len(self._batches) - len(gone) - MAX_REMEMBERED_BATCHES)
        gone += [b for b in self._batches if b not in gone][:overflow]
        entries = []
        for batch_id in gone:
            _, auditor, keys = self._batches.pop(batch_id)
            entries.append(auditor.entry(keys, "unconfirmed"))
        return entries


def relay_handler(
    conn: Connection, agents_account: str, audit: AuditLog | None = None
) -> Callable[[Msg], Awaitable[None]]:
    """The relay's message handler; ``audit``: where operators' writes are recorded (None: nowhere)."""
    pending: set[asyncio.Task[None]] = set()
    batches = BatchKeys()

    async def record(entry: AuditEntry) -> None:
        if audit is not None:
            await audit.record(entry)

    def background(work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def on_write(msg: Msg) -> None:
        who = caller(msg)
        headers = dict(msg.headers or {})
        outcome: tuple[str, dict[str, str]] | str
        auditor: Auditor | None = None
        if who is None:
            # Every relayed write crossed an agent's or operator's import, which sets the caller. Without one it
            # was published inside ZATTERA (the services write the stream directly) or steered there: refused.
            outcome = "no caller identity (Nats-Request-Info): only writes through an import are relayed"
        else:
            is_agent = who.account == agents_account
            outcome = relayed_write(msg.subject, headers, who.name, agent=is_agent)
            if not is_agent and audit is not None:
                auditor = operator_auditor(who, headers)
                for entry in batches.stale():
                    background(record(entry))
        key = written_key(msg.subject, headers)
        batch_id = headers.get("Nats-Batch-Id", "")
        if isinstance(outcome, str):
            log.warning("relay: refused a write of %s: %s", who.name if who else "(no caller)", outcome)
            if auditor is not None:
                # Recorded, then answered, in a task of its own: a slow audit stream holds up no other write.
                keys = [*batches.take(batch_id), key] if batch_id else [key]
                background(
                    refuse(msg.reply if answerable(msg) else "", outcome, auditor.entry(keys, f"refused: {outcome}"))
                )
                return
            if answerable(msg):
                await conn.nc.publish(msg.reply, _refusal(outcome))
            return
        subject, kept = outcome
        if not answerable(msg):  # fire and forget (a batch's inner messages): nothing to answer
            await conn.nc.publish(subject, msg.data, headers=kept or None)
            if auditor is not None:
                if batch_id:
                    batches.remember(batch_id, auditor, key)
                else:
                    background(record(auditor.entry([key], "unconfirmed")))
            return
        # The server never lets a client publish with an ``_R_.`` reply, so the stream's answer comes here
        # and goes on to the agent. Each in its own task: one slow answer does not hold the others back.
        keys = [*batches.take(batch_id), key] if batch_id else [key]
        background(forward(msg.reply, subject, msg.data, kept, auditor, keys))

    async def refuse(reply: str, why: str, entry: AuditEntry) -> None:
        await record(entry)
        if reply:
            await conn.nc.publish(reply, _refusal(why))

    async def forward(
        reply: str, subject: str, data: bytes, headers: dict[str, str], auditor: Auditor | None, keys: list[KeyWrite]
    ) -> None:
        try:
            answer = await conn.nc.request(subject, data, timeout=RELAY_TIMEOUT, headers=headers or None)
        except nats.errors.Error as exc:  # no answer: the writer's own timeout tells it the outcome is unknown
            log.warning("relay: %s not confirmed: %s", subject, exc)
            if auditor is not None:
                await record(auditor.entry(keys, "unconfirmed"))
            return
        if auditor is not None:
            # Recorded before the operator hears of it: an acknowledged write is an audited one.
            outcome, seq = answer_outcome(answer.data)
            await record(auditor.entry(keys, outcome, seq))
        await conn.nc.publish(reply, answer.data, headers=answer.headers)

    return on_write
