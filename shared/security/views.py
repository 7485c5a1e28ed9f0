"""An agent's state view on a secured cluster: a pull consumer that control creates for it.

Agents may not create consumers (a consumer's deliver subject could point at any subject of ``ZATTERA``,
e.g. a key of the state bucket: SECURITY.md). So an agent asks ``zattera.view.open``; the join service
(control credential) reads the node from the server-set ``Nats-Request-Info`` (never from the request),
(re)creates ``view-<node>`` — durable, filtered to that node's keys plus releases and volumes, last value
per key then every change, no acks — and answers its name. The agent then only *pulls* from it
(``$JS.API.CONSUMER.MSG.NEXT.KV_zattera-state.view-<node>``, the one pull its permissions allow); the
pulled messages travel back through the import's reply mapping, like every other reply.

An open cluster uses the same consumer and the same pulls (one code path, and one consumer per agent
instead of one per key pattern): the join service answers ``zattera.view.open`` there too, for the node the
request names (nobody has an identity on an open cluster); where no join service runs at all, the agent
creates the same consumer itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Collection

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.ids import is_safe_id
from shared.security.callers import answerable, caller
from shared.security.permissions import AGENT_STATE_READS, NAME, VIEW_OPEN_SUBJECT, view_consumer
from shared.subjects import STATE_STREAM

log = logging.getLogger(__name__)

VIEW_INACTIVE_THRESHOLD = 3600.0
"""A node gone for an hour loses its consumer (a returning agent opens a new one)."""


class ViewRefused(ZatteraError):
    """The view service said no (the caller is not an agent) or nobody answered."""


class ViewUnavailable(ViewRefused):
    """Nobody answered ``zattera.view.open``: the control plane does not serve it (yet: ``zattera up`` starts
    the control plane and the local node together). Waiting for it is the caller's choice, not a failure."""


def node_view_filters(node_id: str) -> list[str]:
    """The subjects of ``view-<node>``: the agent role's state reads with its node id."""
    return [pattern.replace(NAME, node_id) for pattern in AGENT_STATE_READS.values()]


async def open_view_consumer(conn: Connection, node_id: str) -> str:
    """(Re)create ``view-<node>`` positioned at the last value of each key; returns its name."""
    name = view_consumer(node_id)
    try:
        await conn.js.delete_consumer(STATE_STREAM, name)
    except NotFoundError:
        pass
    config = ConsumerConfig(
        durable_name=name,
        filter_subjects=node_view_filters(node_id),
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=VIEW_INACTIVE_THRESHOLD,
        mem_storage=True,
    )
    await conn.js.add_consumer(STATE_STREAM, config)
    return name


def view_open_handler(
    conn: Connection, *, agents_account: str, agent_issuers: Collection[str]
) -> Callable[[Msg], Awaitable[None]]:
    """Answers ``zattera.view.open`` for agents only: the caller's account must be ``AGENTS`` and its
    credential issued by an agent or builder role key; the node is the credential's name."""

    async def on_request(msg: Msg) -> None:
        if not answerable(msg):
            return
        who = caller(msg)
        if who is None or who.account != agents_account or who.issuer_key not in agent_issuers or not who.name:
            reply: dict[str, str] = {"error": "only an agent credential may open a view"}
        else:
            reply = await _opened(conn, who.name)
        await conn.nc.publish(msg.reply, json.dumps(reply).encode())

    return on_request


def open_cluster_view_handler(conn: Connection) -> Callable[[Msg], Awaitable[None]]:
    """Answers ``zattera.view.open`` on an open cluster: for the node the request names (``{"node": id}``)."""

    async def on_request(msg: Msg) -> None:
        if not answerable(msg):
            return
        try:
            node = str(json.loads(msg.data or b"{}").get("node") or "")
        except (ValueError, AttributeError):
            node = ""
        reply = await _opened(conn, node) if is_safe_id(node) else {"error": "node: a node id"}
        await conn.nc.publish(msg.reply, json.dumps(reply).encode())

    return on_request


async def _opened(conn: Connection, node_id: str) -> dict[str, str]:
    try:
        return {"consumer": await open_view_consumer(conn, node_id)}
    except nats.errors.Error as exc:
        log.warning("view for node %s not opened: %s", node_id, exc)
        return {"error": f"the view consumer could not be created: {exc}"}


async def request_view(conn: Connection, node_id: str, *, secured: bool = True, timeout: float = 5.0) -> str:
    """Ask control for this agent's view consumer (``node_id`` counts only on an open cluster: a secured one
    takes the caller's credential). Unanswered on an open cluster (no join service), the agent creates it
    itself. Raises :class:`ViewRefused` on a refusal, :class:`ViewUnavailable` when nobody answers."""
    body = json.dumps({"node": node_id}).encode()
    try:
        msg = await conn.nc.request(VIEW_OPEN_SUBJECT, body, timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        if not secured:
            return await open_view_consumer(conn, node_id)
        raise ViewUnavailable(f"no view service answered on {VIEW_OPEN_SUBJECT} (the join service serves it)") from exc
    except nats.errors.TimeoutError as exc:
        raise ViewUnavailable(f"no view service answered on {VIEW_OPEN_SUBJECT} (the join service serves it)") from exc
    reply = json.loads(msg.data or b"{}")
    if "error" in reply:
        raise ViewRefused(str(reply["error"]))
    return str(reply["consumer"])
