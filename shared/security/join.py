"""Node join: single-use, expiring tokens exchanged once for a node credential.

``zattera nodes join-token`` asks the join service (``zattera.join.issue``, operator role) for a token. The
token is ``zjt1.<secret>.<sentinel JWT>``: the secret is 256 random bits, and only its SHA-256 is stored
(bucket ``zattera-join``, key = the hash) with its expiry, its node binding and, once used, who used it.
The sentinel is the public bearer credential of the ``JOIN`` account, whose users can do nothing but send
requests to ``zattera.join`` (imported from ``ZATTERA``) and read their replies.

A joining agent generates its own user nkey and sends only the public key with the secret; the join service
marks the token used with a compare-and-set on its revision (a second use, even concurrent, loses) and
answers a user JWT for that key signed by the agent (or builder) scoped key. The seed never leaves the node
and the reply holds nothing secret, which matters because every JOIN user can read ``_INBOX.>`` there.

The joining side (asking for a token, exchanging one) is :mod:`shared.security.join_client`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from shared import keys as K
from shared.audit import AuditLog
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.jetstream import read_state_key
from shared.provisioning import recorded_replicas
from shared.security.accounts import AUTHZ_PREFIX, RELAY_PREFIX
from shared.security.authority import RoleIssuer
from shared.security.authz import Authz
from shared.security.callers import answerable
from shared.security.feeds import Feeds
from shared.security.member_issue import member_issue_handler
from shared.security.permissions import (
    JOIN_BUCKET,
    JOIN_ISSUE_SUBJECT,
    JOIN_REMOVE_SUBJECT,
    JOIN_REMOVE_VIA_PREFIX,
    JOIN_SUBJECT,
    VIEW_OPEN_SUBJECT,
    Role,
)
from shared.security.relay import BATCH_PARTS_SUBJECT, Batches, batch_parts_handler, relay_handler
from shared.security.removal_answers import RecordedAnswers
from shared.security.views import open_cluster_view_handler, view_open_handler
from shared.tasks import serve_until_cancelled
from shared.teams import TEAMS_EVENTS_SUBJECT, TEAMS_FEED_KEEP_SUBJECT, TEAMS_FEED_SUBJECT, TEAMS_ISSUE_SUBJECT

if TYPE_CHECKING:
    from shared.security.machine_service import Machines

log = logging.getLogger(__name__)

TOKEN_PREFIX = "zjt1"
AGENT_ROLES = (Role.AGENT, Role.BUILDER)
"""The roles of a node's agent (a proxy's credential, also minted here, opens no view and relays nothing)."""
DEFAULT_TTL = 3600.0
MAX_TTL = 7 * 24 * 3600.0
REPLY_GRACE = 1.0
"""Seconds between a removal's answer and the update of the ``ZATTERA`` account (which drops reply mappings)."""
REMOVE_FORWARD_TIMEOUT = 110.0
"""How long a removal handed to another server machine's join service may take (its streams' wait included)."""
NODE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
USER_PUBLIC_KEY = re.compile(r"^U[A-Z2-7]{55}$")


class JoinRefused(ZatteraError):
    """The join service said no; the message says why (unknown, used, expired, wrong node…)."""


class JoinUnavailable(JoinRefused):
    """No answer yet (NATS unreachable, no join service running, a timeout): trying again may work."""


@dataclass(frozen=True)
class JoinToken:
    secret: str
    sentinel_jwt: str

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}.{self.secret}.{self.sentinel_jwt}"

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        prefix, _, rest = text.strip().partition(".")
        secret, _, sentinel = rest.partition(".")
        if prefix != TOKEN_PREFIX or not secret or sentinel.count(".") != 2:
            raise JoinRefused(
                "malformed join token: expected the whole zjt1.… string printed by zattera nodes join-token"
            )
        return cls(secret, sentinel)


def token_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return base64.b32encode(os.urandom(32)).decode().rstrip("=").lower()


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec="seconds")


async def ensure_join_bucket(conn: Connection, replicas: int = 1) -> KeyValue:
    """Token records; kept two weeks past the longest token life so a late reuse still reads "used"."""
    try:
        return await conn.js.key_value(JOIN_BUCKET)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        pass
    config = KeyValueConfig(
        bucket=JOIN_BUCKET, history=1, ttl=MAX_TTL + 14 * 24 * 3600, storage=StorageType.FILE, replicas=replicas
    )
    try:
        return await conn.js.create_key_value(config)
    except BadRequestError as exc:
        if exc.err_code != 10058:  # created concurrently by another replica
            raise
        return await conn.js.key_value(JOIN_BUCKET)


@dataclass(eq=False)
class JoinService:
    """Answers ``zattera.join.issue`` (new tokens), ``zattera.join`` (token → node credential) and
    ``zattera.view.open`` (an agent's view consumer, :mod:`shared.security.views`), and relays the agents'
    state writes (:mod:`shared.security.relay`): the control side of the agents' account."""

    conn: Connection
    issuers: dict[Role, RoleIssuer]
    sentinel_jwt: str
    _: KW_ONLY
    now: Callable[[], float] = time.time
    open_cluster: bool = False
    """The server authenticates nobody (security keys prepared, server not secured), so no request carries a
    caller: views are opened for the node a request names, as without keys."""
    machines: Machines | None = None
    """Machines join with one command (machine tokens, server machines, removal)."""
    audit: bool = True
    """Operators' relayed writes are recorded in the audit log (docs/audit.md; off only to measure its cost)."""
    authz: Authz | None = None
    """The authorising path of team members (docs/teams.md): their writes are checked by the relay, their reads
    answered on ``zattera.authz.>``, member credentials minted on ``zattera.teams.issue``."""

    def __post_init__(self) -> None:
        self._audit_log = AuditLog(self.conn) if self.audit else None
        self._kv: KeyValue | None = None
        self._batches = Batches()
        self.ready = asyncio.Event()

    async def run(self) -> None:
        self._kv = await ensure_join_bucket(self.conn, replicas=await recorded_replicas(self.conn.js))
        subs = [
            await self.conn.nc.subscribe(JOIN_SUBJECT, queue="join", cb=self._answer(self.join)),
            await self.conn.nc.subscribe(JOIN_ISSUE_SUBJECT, queue="join", cb=self._answer(self.issue)),
            await self.conn.nc.subscribe(
                JOIN_REMOVE_SUBJECT, queue="join", cb=self._answer(self.remove, then=self._after_removal)
            ),
            *(
                [await self.conn.nc.subscribe(f"{JOIN_REMOVE_VIA_PREFIX}{mine}", cb=self._answer(self.remove_here))]
                if (mine := self.machines.node_id if self.machines is not None else "")
                else []
            ),
            await self.conn.nc.subscribe(VIEW_OPEN_SUBJECT, queue="join", cb=self._view_open()),
            await self.conn.nc.subscribe(BATCH_PARTS_SUBJECT, cb=batch_parts_handler(self._batches)),
            await self.conn.nc.subscribe(f"{RELAY_PREFIX}>", queue="relay", cb=self._relay()),
        ]
        feeds = Feeds(self.conn, self.authz) if self.authz is not None else None
        if self.authz is not None and feeds is not None:
            await self.authz.start()
            subs += [
                await self.conn.nc.subscribe(f"{AUTHZ_PREFIX}>", queue="authz", cb=self.authz.read_handler()),
                await self.conn.nc.subscribe(
                    TEAMS_ISSUE_SUBJECT,
                    queue="authz",
                    cb=member_issue_handler(self.conn, self.authz.issuer, self.authz.admins_account),
                ),
                await self.conn.nc.subscribe(TEAMS_EVENTS_SUBJECT, queue="authz", cb=self.authz.events_handler()),
                await self.conn.nc.subscribe(TEAMS_FEED_SUBJECT, queue="authz", cb=feeds.feed_handler()),
                # Every join service: the one holding the feed acts on its keepalive.
                await self.conn.nc.subscribe(TEAMS_FEED_KEEP_SUBJECT, cb=feeds.keep_handler()),
            ]
        await self.conn.nc.flush()
        if self.machines is not None:
            await self.machines.started(self.kv)
        try:
            await serve_until_cancelled(self.ready, subs)
        finally:
            if feeds is not None:
                await feeds.stop()
            if self.authz is not None:
                await self.authz.stop()

    def _agents_account(self) -> str:
        agents = {issuer.account_public_key for role, issuer in self.issuers.items() if role in AGENT_ROLES}
        if len(agents) != 1:
            raise ValueError("the agent and builder role keys must belong to one account (AGENTS)")
        return agents.pop()

    def _view_open(self) -> Callable[[Msg], Any]:
        if self.open_cluster:
            return open_cluster_view_handler(self.conn)
        issuers = {issuer.signing_key.public_key for role, issuer in self.issuers.items() if role in AGENT_ROLES}
        return view_open_handler(self.conn, agents_account=self._agents_account(), agent_issuers=issuers)

    def _relay(self) -> Callable[[Msg], Any]:
        return relay_handler(self.conn, self._agents_account(), self._batches, self._audit_log, self.authz)

    def _answer(
        self,
        handler: Callable[[dict[str, Any]], Any],
        then: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> Callable[[Msg], Any]:
        """``then``: run with the reply once it is sent."""

        async def callback(msg: Msg) -> None:
            if not answerable(msg):
                return  # a reply steered at some other subject: nobody to answer
            try:
                request = json.loads(msg.data or b"{}")
                if not isinstance(request, dict):
                    raise JoinRefused("bad request: expected a JSON object")
                reply: dict[str, Any] = await handler(request)
            except ZatteraError as exc:  # JoinRefused, or a refusal of the machines' part
                reply = {"error": str(exc)}
            except (ValueError, TypeError) as exc:
                reply = {"error": f"bad request: {exc}"}
            except (TimeoutError, NatsError) as exc:  # never left without an answer
                log.warning("join service: %s: %s", msg.subject, exc)
                reply = {"error": f"the cluster did not answer: {exc}"}
            await self.conn.nc.publish(msg.reply, json.dumps(reply).encode())
            if then is not None:
                await self.conn.nc.flush()
                server = self.conn.nc.connected_url
                log.info(
                    "%s answered through %s:%s",
                    msg.subject,
                    server.hostname if server else "?",
                    server.port if server else "?",
                )
                await then(reply)

        return callback

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "JoinService.run() first"
        return self._kv

    async def issue(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            ttl = float(request.get("ttl") or DEFAULT_TTL)
        except (OverflowError, ValueError, TypeError):
            ttl = float("nan")  # refused below, with the same message
        if not 0 < ttl <= MAX_TTL:
            raise JoinRefused(f"ttl must be between 1 s and {int(MAX_TTL)} s")
        node_id = str(request.get("node_id") or "")
        if node_id and not NODE_ID.match(node_id):
            raise JoinRefused("node_id may contain only letters, digits, '-' and '_' (at most 64)")
        server = bool(request.get("server"))
        role = Role.BUILDER if request.get("builder") or server else Role.AGENT
        secret = str(request.get("secret") or "") if server else new_secret()
        if server and (len(secret) < 40 or not request.get("bundle")):
            raise JoinRefused("a server token needs its secret and sealed bundle (zattera nodes join-token --server)")
        expires_at = self.now() + ttl
        record: dict[str, Any] = {
            "expires_at": expires_at,
            "node_id": node_id,
            "role": str(role),
            "created_at": self.now(),
            **({"server": True, "bundle": str(request["bundle"])} if server else {}),
        }
        try:
            await self.kv.create(token_hash(secret), json.dumps(record).encode())
        except (KeyWrongLastSequenceError, BadRequestError):
            raise JoinRefused("this token secret was used before: ask for a new token") from None
        log.info(
            "join token issued (node %s, %s, expires %s)",
            node_id or "any",
            "server" if server else role,
            _iso(expires_at),
        )
        reply: dict[str, Any] = {"token": str(JoinToken(secret, self.sentinel_jwt)), "expires_at": expires_at}
        if self.machines is not None:
            reply["machine_token"] = await self.machines.token(self.kv, secret, self.sentinel_jwt)
        return reply

    async def remove(self, request: dict[str, Any]) -> dict[str, Any]:
        """Remove a machine (``zattera nodes remove``, after its drain), or retire the first machine's extra
        seats (``{"seats": true}``): see :mod:`shared.security.membership`. Handed to another server machine's
        join service when this one is the machine removed (or not the one with the seats). Run once per
        ``request_id`` (:mod:`shared.security.removal_answers`): asked again, the first asking's answer."""
        node_id, seats = await self._removal(request)
        request_id = str(request.get("request_id") or "")
        if not request_id:
            return await self._remove(request, node_id, seats)
        answers = RecordedAnswers(self.kv, wait=REMOVE_FORWARD_TIMEOUT)
        return await answers.once(request_id, lambda: self._remove(request, node_id, seats))

    async def _remove(self, request: dict[str, Any], node_id: str, seats: bool) -> dict[str, Any]:
        assert self.machines is not None
        via = await self.machines.forward_to(self.kv, node_id, seats)
        if not via:
            return await self.remove_here(request)
        try:
            forwarded = json.dumps({**request, "node_id": node_id}).encode()
            subject = f"{JOIN_REMOVE_VIA_PREFIX}{via}"
            msg = await self.conn.nc.request(subject, forwarded, timeout=REMOVE_FORWARD_TIMEOUT)
        except (NatsError, TimeoutError):
            raise JoinRefused(f"the join service of server machine {via} did not answer") from None
        reply: dict[str, Any] = json.loads(msg.data or b"{}")
        if "error" in reply:
            raise JoinRefused(str(reply["error"]))
        return reply

    async def _after_removal(self, reply: dict[str, Any]) -> None:
        """Once a removal is answered: the services' and system accounts get its revocations."""
        if self.machines is None or not reply.get("revoked") or not reply.get("staying") or reply.get("repeated"):
            return  # a removal asked again: its first asking pushed them
        # The answer crosses the routes through a reply mapping the update of ZATTERA drops: give it a moment.
        await asyncio.sleep(REPLY_GRACE)
        try:
            await self.machines.push_control_accounts([str(u) for u in reply["staying"]])
        except (ZatteraError, OSError, TimeoutError, NatsError) as exc:
            log.error("revocations not pushed to the services' and system accounts: %s", exc)

    async def remove_here(self, request: dict[str, Any]) -> dict[str, Any]:
        node_id, seats = await self._removal(request)
        assert self.machines is not None
        doing = f"retiring the extra seats of {node_id}" if seats else f"removing {node_id}"
        try:
            async with self.machines.bounded(doing):
                if seats:
                    return await self.machines.retire_seats(self.kv)
                return await self.machines.remove(self.kv, node_id, self.now(), force=bool(request.get("force")))
        except ZatteraError as exc:
            raise JoinRefused(str(exc)) from None

    async def _removal(self, request: dict[str, Any]) -> tuple[str, bool]:
        seats = bool(request.get("seats"))
        if self.machines is None:
            raise JoinRefused("this join service cannot remove machines (no security setup)")
        if seats:
            node_id = str(request.get("node_id") or "") or await self.machines.seats_holder(self.kv)
        else:
            node_id = str(request.get("node_id") or "")
        if not NODE_ID.match(node_id):
            raise JoinRefused("node_id may contain only letters, digits, '-' and '_' (at most 64)")
        return node_id, seats

    async def join(self, request: dict[str, Any]) -> dict[str, Any]:
        secret = str(request.get("secret") or "")
        node_id = str(request.get("node_id") or "")
        public_key = str(request.get("public_key") or "")
        if not NODE_ID.match(node_id):
            raise JoinRefused("node_id may contain only letters, digits, '-' and '_' (at most 64)")
        if not USER_PUBLIC_KEY.match(public_key):
            raise JoinRefused("public_key must be a NATS user public key (U…)")
        key = token_hash(secret)
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            raise JoinRefused("unknown join token") from None
        record = json.loads(entry.value or b"{}")
        if record.get("used_by"):
            raise JoinRefused(
                f"join token already used (node {record['used_by']} joined with it at {_iso(record['used_at'])})"
            )
        if self.now() >= float(record["expires_at"]):
            raise JoinRefused(f"join token expired at {_iso(float(record['expires_at']))}; ask for a new one")
        bound = str(record.get("node_id") or "")
        if bound and bound != node_id:
            raise JoinRefused(f"this join token is for node {bound}, not {node_id}")
        if not bound and await self._node_registered(node_id):
            raise JoinRefused(
                f"a machine named {node_id} is already in the cluster; pick another name, or re-join it with a "
                f"token bound to it (zattera nodes join-token --node {node_id})"
            )
        proxy_key = str(request.get("proxy_public_key") or "")
        if proxy_key and (not USER_PUBLIC_KEY.match(proxy_key) or Role.PROXY not in self.issuers):
            raise JoinRefused("proxy_public_key must be a NATS user public key (U…)")
        if record.get("server") and self.machines is not None and await self.machines.is_server(self.kv, node_id):
            raise JoinRefused(f"a server machine named {node_id} is already in the cluster")
        if record.get("server") and self.machines is not None and not await self.machines.has_servers(self.kv):
            raise JoinRefused("cannot join as a server machine: no server machine is registered yet; try again")
        used = {**record, "used_by": node_id, "used_at": self.now(), "public_key": public_key}
        used.pop("bundle", None)  # handed over once, then gone
        if proxy_key:
            used["proxy_public_key"] = proxy_key
        try:
            await self.kv.update(key, json.dumps(used).encode(), last=entry.revision)
        except KeyWrongLastSequenceError:
            raise JoinRefused("join token already used") from None
        role = Role(record.get("role") or Role.AGENT)
        log.info("node %s joined (role %s, user %s)", node_id, role, public_key)
        reply = {"jwt": self.issuers[role].user_jwt(node_id, public_key), "node_id": node_id, "role": str(role)}
        if proxy_key:
            reply["proxy_jwt"] = self.issuers[Role.PROXY].user_jwt(node_id, proxy_key)
        if self.machines is not None:
            reply |= await self.machines.joined(self.kv, node_id)
        if record.get("server"):
            reply["bundle"] = str(record.get("bundle") or "")
        return reply

    async def _node_registered(self, node_id: str) -> bool:
        return (await read_state_key(self.conn.js, K.node(node_id))).data is not None
