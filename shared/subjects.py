"""Every bucket, stream, object store and subject name of the wire contract (docs/wire-contract.md), named
once for every publisher and subscriber."""

from __future__ import annotations

from nats.aio.msg import Msg

STATE_BUCKET = "zattera-state"


LIVE_BUCKET = "zattera-live"


STATE_STREAM = f"KV_{STATE_BUCKET}"


LIVE_STREAM = f"KV_{LIVE_BUCKET}"


STATE_PREFIX = f"$KV.{STATE_BUCKET}."


LIVE_PREFIX = f"$KV.{LIVE_BUCKET}."


EVENTS_STREAM = "ZATTERA_EVENTS"


EVENTS_SUBJECT_PREFIX = "zattera.events."


ROUTES_STREAM = "ZATTERA_ROUTES"


ROUTES_SNAPSHOT_SUBJECT = "zattera.routes.snapshot"


ROUTES_GET_SUBJECT = "zattera.routes.get"


ACTIVATE_SUBJECT = "zattera.activate"


BUILD_LOGS_STREAM = "ZATTERA_BUILD_LOGS"


BUILD_EVENTS_STREAM = "ZATTERA_BUILD_EVENTS"


SOURCES_STORE = "zattera-sources"


IMAGES_STORE = "zattera-images"


SNAPSHOTS_STORE = "zattera-snapshots"


def build_log_subject(build_id: str) -> str:
    return f"zattera.builds.{build_id}.log"


def build_events_subject(build_id: str, node_id: str = "*") -> str:
    """Events of ``build_id`` sent by the builder on ``node_id`` (``*``: from any node). The node token is
    permission-enforced (a builder may publish only its own, SECURITY.md): the dispatcher accepts a build's
    events only from the node the build was assigned to."""
    return f"zattera.builds.{build_id}.events.{node_id}"


def agent_subject(node_id: str, verb: str) -> str:
    return f"zattera.agent.{node_id}.{verb}"


INBOX_PREFIX = "_INBOX."


def is_direct_request(msg: Msg) -> bool:
    """True when ``msg`` was published by a client as a request (reply to one of its inboxes).

    nats-server delivers JetStream API replies and consumer deliveries to whatever subject the requester
    names, without checking that requester's publish rights (SECURITY.md, "Open"): such a redirected
    message arrives with no reply subject (an API reply) or a ``$JS.ACK`` one (a delivery). Handlers that
    act on requests (an agent's snapshot, restore, prune and build subjects) only act on direct ones.
    A request that crossed an account import (SECURITY.md, role accounts) has a server-made ``_R_.`` reply."""
    return msg.reply.startswith((INBOX_PREFIX, "_R_."))


JS_API_PREFIX = "$JS.API."


CLUSTER_REPLICAS_SUBJECT = "zattera.cluster.replicas"
"""Operator → join service: every stream's replica count changed, one stream per request (shared/replicas.py)."""


GITHOOKS_DELIVER_SUBJECT = "zattera.githooks.deliver"
"""The console → secrets service request carrying one webhook delivery (docs/git.md): headers
``Zattera-Hook`` (the hook id), ``Zattera-Provider`` and the provider's own, the body verbatim; the reply is
JSON ``{"status": 202|401|404|409|503, "message"}``."""

GITHOOKS_STREAM = "ZATTERA_GITHOOKS"
"""Verified deliveries (subjects ``zattera.githooks.delivery.<hook id>``), de-duplicated by ``Nats-Msg-Id``
= ``<hook id>:<delivery id>`` over its duplicate window: a replay is refused; the ``githooks`` leader loop
consumes them (durable ``githooks``)."""

GITHOOKS_DELIVERY_PREFIX = "zattera.githooks.delivery."
AUDIT_STREAM = "ZATTERA_AUDIT"
"""The audit log (docs/audit.md): one JSON entry per operator write, append-only, its own retention."""
AUDIT_SUBJECT_PREFIX = "zattera.audit."
"""``zattera.audit.<source>`` (``cli``, ``console``, ``webhook``): published by control only."""
LEASE_PROBE_PREFIX = "zattera.lease.probe."
"""``zattera.lease.probe.<id>``: a leader loop's holder answers an empty request here while its connection lives
(:mod:`shared.lease`); the subject is in its ``Lease.probe``. Control only (the operator may neither publish nor
subscribe here)."""
