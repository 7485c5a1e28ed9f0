"""The relay of agents' and operators' state-bucket writes (secured clusters, SECURITY.md).

The state stream accepts rollup headers (its ``subject_delete_marker_ttl`` forces ``allow_rollup_hdrs``),
so a publish with ``Nats-Rollup: all`` on one's own key would erase every key. Agents' and operators' writes
therefore do not reach the stream directly: their account's import renames ``$KV.zattera-state.<key>`` to
``zattera.relay.$KV.zattera-state.<key>`` in ``ZATTERA``, where this relay (run by the join service, control
credential) republishes the value with only the headers a key write needs, and returns the stream's answer
(ack or error) unchanged. An agent's ``observed``/``node`` key must be its own node's
(``Nats-Request-Info``), and nobody but the services writes a lease: the permissions already say so, this
checks it once more. A message without caller identity did not come through an import and is refused.

Every join service relays (queue group ``relay``), so the messages of one atomic batch reach different
relays. The stream needs a batch's messages in order on one connection, so a relay does not publish a
batch's inner message itself: it passes it, checked, to every relay (``zattera.relaybatch``, inside
``ZATTERA``), and the relay that gets the commit publishes the whole batch in order once it holds every
message before it (:class:`Batches`).

Every operator write it sees — stored, refused by it or by the stream — is recorded in the audit log
(:mod:`shared.audit`) with the identity the server set, before the answer goes back to the operator: the relay
is the one place every secured operator write crosses. An atomic batch is one entry, recorded by the relay
holding its commit (which holds every message of the batch by then).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import nats
from nats.aio.msg import Msg

from shared.audit import (
    ACTION_HEADER,
    REQUEST_ID_HEADER,
    USER_HEADER,
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

if TYPE_CHECKING:
    from shared.security.authz import Authz

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
BATCH_PARTS_SUBJECT = "zattera.relaybatch"
"""Where a relay passes a batch's checked inner messages to every relay (never exported: only control)."""
PART_SUBJECT_HEADER = "Zattera-Relay-Subject"
PART_CALLER_HEADER = "Zattera-Relay-Caller"
BATCH_WAIT = 3.0
"""How long the relay holding a batch's commit waits for the messages before it (then: refused, incomplete)."""
BATCH_KEEP = 30.0
"""How long a batch's messages are kept without their commit (a writer that died mid-batch)."""
WRONG_LAST_SEQUENCE = 10071


@dataclass
class _Batch:
    parts: dict[int, tuple[str, bytes, dict[str, str]]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    since: float = field(default_factory=time.monotonic)


class Batches:
    """The inner messages of atomic batches in flight, by (caller, batch id), as every relay received them."""

    def __init__(self) -> None:
        self._batches: dict[tuple[str, str], _Batch] = {}

    def _batch(self, key: tuple[str, str]) -> _Batch:
        now = time.monotonic()
        for old in [k for k, b in self._batches.items() if now - b.since > BATCH_KEEP]:
            del self._batches[old]
        return self._batches.setdefault(key, _Batch())

    def add(self, msg: Msg) -> None:
        """A checked inner message another relay (or this one) passed on."""
        headers = dict(msg.headers or {})
        subject, who = headers.pop(PART_SUBJECT_HEADER, ""), headers.pop(PART_CALLER_HEADER, "")
        try:
            seq = int(headers.get("Nats-Batch-Sequence", ""))
        except ValueError:
            return
        batch = self._batch((who, headers.get("Nats-Batch-Id", "")))
        batch.parts[seq] = (subject, msg.data, headers)
        batch.changed.set()

    async def before(self, who: str, batch_id: str, commit_seq: int) -> list[tuple[str, bytes, dict[str, str]]] | None:
        """The messages 1 … ``commit_seq`` - 1 of a batch, in order, once all arrived; None after :data:`BATCH_WAIT`."""
        key = (who, batch_id)
        batch = self._batch(key)
        deadline = time.monotonic() + BATCH_WAIT
        while any(seq not in batch.parts for seq in range(1, commit_seq)):
            batch.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                self._batches.pop(key, None)
                return None
            try:
                await asyncio.wait_for(batch.changed.wait(), left)
            except TimeoutError:
                continue
        self._batches.pop(key, None)
        return [batch.parts[seq] for seq in range(1, commit_seq)]


NO_LEADER = json.dumps(
    {"error": {"code": 503, "err_code": 10008, "description": "no stream leader answered the relay"}}
).encode()
"""The relay's answer to a write nobody took (JetStream's own "temporarily unavailable": nothing was stored)."""


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


def relay_handler(
    conn: Connection,
    agents_account: str,
    batches: Batches | None = None,
    audit: AuditLog | None = None,
    authz: Authz | None = None,
) -> Callable[[Msg], Awaitable[None]]:
    """The relay's handler of ``zattera.relay.>``; ``batches``: the batch messages this relay holds (filled by
    :func:`batch_parts_handler` on :data:`BATCH_PARTS_SUBJECT`); ``audit``: where operators' writes are
    recorded (None: nowhere); ``authz``: team members' writes are checked against their grants (None: members
    are refused)."""
    pending: set[asyncio.Task[None]] = set()
    held = batches if batches is not None else Batches()

    def background(work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def record(auditor: Auditor | None, keys: list[KeyWrite], outcome: str, seq: int = 0) -> None:
        if auditor is not None and audit is not None:
            await audit.record(auditor.entry(keys, outcome, seq))

    async def on_write(msg: Msg) -> None:
        who = caller(msg)
        claims = dict(msg.headers or {})
        outcome: tuple[str, dict[str, str]] | str
        auditor: Auditor | None = None
        if who is None:
            # Every relayed write crossed an agent's or operator's import, which sets the caller. Without one it
            # was published inside ZATTERA (the services write the stream directly) or steered there: refused.
            outcome = "no caller identity (Nats-Request-Info): only writes through an import are relayed"
        else:
            is_agent = who.account == agents_account
            outcome = relayed_write(msg.subject, claims, who.name, agent=is_agent)
            if not is_agent and audit is not None:
                auditor = operator_auditor(who, claims)
            if not isinstance(outcome, str) and authz is not None and authz.is_member(who):
                # A team member (docs/teams.md): its grant for the key's project, read now, decides — in a task
                # of its own, so the reads it takes hold up no agent's write behind it. A batch's messages need
                # no order here (the relay holding the commit orders them).
                background(checked(authz, msg, who, claims, outcome, auditor))
                return
        await act(msg, who, claims, outcome, auditor)

    async def checked(
        authz: Authz,
        msg: Msg,
        who: Caller,
        claims: dict[str, str],
        outcome: tuple[str, dict[str, str]],
        auditor: Auditor | None,
    ) -> None:
        refused = await authz.check_write(who, outcome[0], msg.data, claims)
        await act(msg, who, claims, f"not authorised: {refused}" if refused else outcome, auditor)

    async def act(
        msg: Msg,
        who: Caller | None,
        claims: dict[str, str],
        outcome: tuple[str, dict[str, str]] | str,
        auditor: Auditor | None,
    ) -> None:
        key = written_key(msg.subject, claims)
        if isinstance(outcome, str):
            log.warning("relay: refused a write of %s: %s", who.name if who else "(no caller)", outcome)
            if auditor is not None:
                # Recorded, then answered, in a task of its own: a slow audit stream holds up no other write.
                background(refuse(msg.reply if answerable(msg) else "", outcome, auditor, key))
            elif answerable(msg):
                await conn.nc.publish(msg.reply, _refusal(outcome))
            return
        assert who is not None
        subject, headers = outcome
        batch_id = headers.get("Nats-Batch-Id", "")
        if not answerable(msg):  # fire and forget: a batch's inner message, passed to every relay
            if batch_id:
                part = headers | {PART_SUBJECT_HEADER: subject, PART_CALLER_HEADER: who.user}
                await conn.nc.publish(BATCH_PARTS_SUBJECT, msg.data, headers=part)
            else:
                await conn.nc.publish(subject, msg.data, headers=headers or None)
                background(record(auditor, [key], "unconfirmed"))
            return
        # The server never lets a client publish with an ``_R_.`` reply, so the stream's answer comes here
        # and goes on to the agent. Each in its own task: one slow answer does not hold the others back.
        if batch_id:
            background(commit(msg.reply, who.user, subject, msg.data, headers, auditor, key))
        else:
            background(forward(msg.reply, subject, msg.data, headers, auditor, [key]))

    async def refuse(reply: str, why: str, auditor: Auditor, key: KeyWrite) -> None:
        await record(auditor, [key], f"refused: {why}")
        if reply:
            await conn.nc.publish(reply, _refusal(why))

    async def commit(
        reply: str,
        who: str,
        subject: str,
        data: bytes,
        headers: dict[str, str],
        auditor: Auditor | None,
        key: KeyWrite,
    ) -> None:
        try:
            count = int(headers.get("Nats-Batch-Sequence", ""))
        except ValueError:
            await record(auditor, [key], "refused: Nats-Batch-Sequence must be a number")
            await conn.nc.publish(reply, _refusal("Nats-Batch-Sequence must be a number"))
            return
        parts = await held.before(who, headers["Nats-Batch-Id"], count)
        if parts is None:
            log.warning("relay: batch %s incomplete: its messages did not all arrive", headers["Nats-Batch-Id"])
            await record(auditor, [key], "refused: atomic publish batch is incomplete at the relay")
            await conn.nc.publish(reply, _refusal("atomic publish batch is incomplete at the relay"))
            return
        for part_subject, part_data, part_headers in parts:
            await conn.nc.publish(part_subject, part_data, headers=part_headers)
        keys = [written_key(part_subject, part_headers) for part_subject, _, part_headers in parts]
        await forward(reply, subject, data, headers, auditor, [*keys, key])

    async def forward(
        reply: str, subject: str, data: bytes, headers: dict[str, str], auditor: Auditor | None, keys: list[KeyWrite]
    ) -> None:
        try:
            answer = await conn.nc.request(subject, data, timeout=RELAY_TIMEOUT, headers=headers or None)
        except nats.errors.NoRespondersError:
            # Nobody took the write (the stream is electing a leader): nothing was stored, and the writer hears so
            # at once — a 503, which it answers by sending again — instead of waiting out its own timeout.
            log.warning("relay: %s found no stream leader", subject)
            await record(auditor, keys, "refused: no stream leader (503)")
            await conn.nc.publish(reply, NO_LEADER)
            return
        except nats.errors.Error as exc:  # no answer: the writer's own timeout tells it the outcome is unknown
            log.warning("relay: %s not confirmed: %s", subject, exc)
            await record(auditor, keys, "unconfirmed")
            return
        # Recorded before the operator hears of it: an acknowledged write is an audited one.
        outcome, seq = answer_outcome(answer.data)
        await record(auditor, keys, outcome, seq)
        await conn.nc.publish(reply, answer.data, headers=answer.headers)

    return on_write


def batch_parts_handler(batches: Batches) -> Callable[[Msg], Awaitable[None]]:
    """Every relay's handler of :data:`BATCH_PARTS_SUBJECT` (no queue group: each relay keeps every part)."""

    async def on_part(msg: Msg) -> None:
        batches.add(msg)

    return on_part
