"""The relay of agents' and operators' state-bucket writes (secured clusters, SECURITY.md).

The state stream accepts rollup headers (its ``subject_delete_marker_ttl`` forces ``allow_rollup_hdrs``),
so a publish with ``Nats-Rollup: all`` on one's own key would erase every key. Agents' and operators' writes
therefore do not reach the stream directly: their account's import renames ``$KV.zattera-state.<key>`` to
``zattera.relay.$KV.zattera-state.<key>`` in ``ZATTERA``, where this relay (run by the join service, control
credential) republishes the value with only the headers a key write needs, and returns the stream's answer
(ack or error) unchanged. An agent's ``observed``/``node`` key must be its own node's
(``Nats-Request-Info``), and nobody but the services writes a lease: the permissions already say so, this
checks it once more. A message without caller identity did not come through an import and is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.msg import Msg

from shared.connection import Connection
from shared.security.accounts import RELAY_PREFIX
from shared.security.callers import answerable, caller
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


def relay_handler(conn: Connection, agents_account: str) -> Callable[[Msg], Awaitable[None]]:
    pending: set[asyncio.Task[None]] = set()

    async def on_write(msg: Msg) -> None:
        who = caller(msg)
        outcome: tuple[str, dict[str, str]] | str
        if who is None:
            # Every relayed write crossed an agent's or operator's import, which sets the caller. Without one it
            # was published inside ZATTERA (the services write the stream directly) or steered there: refused.
            outcome = "no caller identity (Nats-Request-Info): only writes through an import are relayed"
        else:
            is_agent = who.account == agents_account
            outcome = relayed_write(msg.subject, dict(msg.headers or {}), who.name, agent=is_agent)
        if isinstance(outcome, str):
            log.warning("relay: refused a write of %s: %s", who.name if who else "(no caller)", outcome)
            if answerable(msg):
                await conn.nc.publish(msg.reply, _refusal(outcome))
            return
        subject, headers = outcome
        if not answerable(msg):  # fire and forget (a batch's inner messages): nothing to answer
            await conn.nc.publish(subject, msg.data, headers=headers or None)
            return
        # The server never lets a client publish with an ``_R_.`` reply, so the stream's answer comes here
        # and goes on to the agent. Each in its own task: one slow answer does not hold the others back.
        task = asyncio.create_task(forward(msg.reply, subject, msg.data, headers))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def forward(reply: str, subject: str, data: bytes, headers: dict[str, str]) -> None:
        try:
            answer = await conn.nc.request(subject, data, timeout=RELAY_TIMEOUT, headers=headers or None)
        except nats.errors.Error as exc:  # no answer: the writer's own timeout tells it the outcome is unknown
            log.warning("relay: %s not confirmed: %s", subject, exc)
            return
        await conn.nc.publish(reply, answer.data, headers=answer.headers)

    return on_write
