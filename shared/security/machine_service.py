"""The join service's part in machines joining and leaving (:mod:`shared.security.membership` holds the
records): machine tokens name the cluster's servers and CA, a join gets a mesh address and the routes of
every server, a removal peer-removes and revokes. Runs on server machines, with the control credential and
the machine's security directory (the operator and account keys sign revocations; the system credential
pushes them and asks JetStream to remove a peer)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared import keys as K
from shared.connection import Connection, connect
from shared.embedded import RETIRED_SEATS_FILE
from shared.errors import ZatteraError
from shared.provisioning import js_api
from shared.replicas import plan
from shared.security import membership
from shared.security.machines import MachineToken
from shared.security.permissions import JOIN_BUCKET
from shared.subjects import STATE_BUCKET

log = logging.getLogger(__name__)
T = TypeVar("T")

STREAMS_WAIT = 60.0
"""How long a removal waits for every stream to be back at its replica count on the remaining servers."""
ANSWER_WITHIN = 100.0
"""A removal or a retirement answers within this many seconds (``zattera nodes remove`` waits 130 s for it, a
join service handing it over 110 s): its waits — the meta leadership, the meta group, the copies — share it,
and a JetStream request left unanswered meanwhile is cut at its end (an answer that comes after the asker gave
up is lost, and the removal would look undone)."""
STEP_GRACE = 5.0
"""A removal or a retirement still running this long after :data:`ANSWER_WITHIN` is cut (a request bounded
only by its own timeout ran over): it answers an error naming the step it stopped in, before its asker gives up."""

_STEP: contextvars.ContextVar[str] = contextvars.ContextVar("removal_step", default="starting")


def at_step(what: str) -> None:
    """Name the step the removal (or retirement) of this task is in, for the error if it is cut there."""
    _STEP.set(what)


@dataclass
class Machines:
    conn: Connection
    urls: str
    """The URLs this service's connection uses (pushes and peer removal go there)."""
    security_dir: Path
    tls_ca: str = ""
    node_id: str = ""
    """This server machine's node id ('' when the service does not run on a server machine of its own)."""
    client_url: str = ""
    """Where other machines reach this machine's NATS server (its advertised client URL)."""
    route_url: str = ""
    mesh_ip: str = ""
    """This server machine's mesh address, recorded as taken at start."""
    server_names: list[str] = field(default_factory=list)
    """This machine's NATS servers' names (the first machine: its seats, the first named like the node)."""
    control_dir: Path | None = None
    """The control dir (the first machine's retired seats are recorded there for ``zattera up``)."""
    streams_wait: float = STREAMS_WAIT
    answer_within: float = ANSWER_WITHIN
    ca_pem: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.ca_pem = Path(self.tls_ca).read_text() if self.tls_ca else ""

    @contextlib.asynccontextmanager
    async def bounded(self, doing: str, grace: float = STEP_GRACE) -> AsyncIterator[None]:
        """Cut ``doing`` (a removal, a retirement) at :attr:`answer_within` plus ``grace``: :class:`TimeoutError`
        naming the step it was in (:func:`at_step`). A timeout of its own inside passes through as it is."""
        bound = self.answer_within + grace
        token = _STEP.set("starting")
        try:
            async with asyncio.timeout(bound) as cut:
                yield
        except TimeoutError:
            if not cut.expired():
                raise
            raise TimeoutError(f"{doing} was cut after {bound:.0f} s while {_STEP.get()}") from None
        finally:
            _STEP.reset(token)

    @property
    def system_creds(self) -> str:
        return str(self.security_dir / "creds" / "system.creds")

    @property
    def control_creds(self) -> str:
        return str(self.security_dir / "creds" / "control.creds")

    async def started(self, kv: KeyValue) -> None:
        """Register this server machine; bring this machine's account JWTs up to the cluster's revocations."""
        if self.node_id and self.client_url:
            names, client_url, route_url = self._serving()
            users = membership.local_users(self.security_dir)
            await membership.register_server(kv, self.node_id, client_url, route_url, names, users)
        if self.node_id and self.mesh_ip:
            await membership.claim_mesh_ip(kv, self.node_id, self.mesh_ip)
        revoked = await membership.revocations(kv)
        if revoked:
            authority = membership.apply_revocations(self.security_dir, revoked)
            try:
                await membership.push_accounts(self.urls, self.system_creds, self.tls_ca, authority)
            except (ZatteraError, OSError, TimeoutError) as exc:
                log.warning("revocations not pushed at start: %s", exc)

    async def token(self, kv: KeyValue, secret: str, sentinel: str) -> str:
        known = await membership.servers(kv)
        urls = [u for s in known.values() for u in s.get("client_url", "").split(",") if u] or [
            self.client_url or self.urls
        ]
        return str(MachineToken(secret, sentinel, tuple(dict.fromkeys(urls)), self.ca_pem))

    async def has_servers(self, kv: KeyValue) -> bool:
        """Whether any server machine is registered (a server machine joins their routes: none, nothing to join)."""
        return bool(await membership.servers(kv))

    async def is_server(self, kv: KeyValue, node_id: str) -> bool:
        return node_id in await membership.servers(kv)

    async def joined(self, kv: KeyValue, node_id: str) -> dict[str, Any]:
        """What a joining machine is told besides its credentials: its mesh address, the servers."""
        known = await membership.servers(kv)
        return {
            "mesh_ip": await membership.mesh_ip(kv, node_id),
            "routes": [u for s in known.values() for u in s.get("route_url", "").split(",") if u],
            "servers": [u for s in known.values() for u in s.get("client_url", "").split(",") if u],
        }

    def _serving(self) -> tuple[list[str], str, str]:
        """This machine's server names and URLs without the seats it retired."""
        names = self.server_names or [self.node_id]
        clients, routes = self.client_url.split(","), self.route_url.split(",")
        retired = set(self.retired_seats())
        kept = [i for i, n in enumerate(names) if n not in retired] or [0]

        def pick(urls: list[str]) -> str:
            return ",".join(urls[i] for i in kept if i < len(urls))

        return [names[i] for i in kept if i < len(names)], pick(clients), pick(routes)

    def retired_seats(self) -> list[str]:
        if self.control_dir is None or not (self.control_dir / RETIRED_SEATS_FILE).exists():
            return []
        return [str(n) for n in json.loads((self.control_dir / RETIRED_SEATS_FILE).read_text())]

    async def push_control_accounts(self, staying: list[str]) -> None:
        """After a removal's answer: ``ZATTERA``'s and the system account's JWTs with every revocation of the
        cluster (a removed server machine's control, operator-role and system users), read and pushed through
        the servers that stay (see :func:`membership.push_accounts`)."""
        async with self._staying(staying) as conn:
            revoked = await membership.revocations(await conn.js.key_value(JOIN_BUCKET))
        authority = membership.apply_revocations(self.security_dir, revoked)
        await membership.push_accounts(",".join(staying), self.system_creds, self.tls_ca, authority, control=True)
        log.info("revocations pushed to the services' and system accounts")

    async def known_servers(self) -> dict[str, dict[str, Any]]:
        """The registered server machines, read through a connection of its own (see :meth:`_staying`)."""
        async with self._staying(self.urls.split(",")) as conn:
            return await membership.servers(await conn.js.key_value(JOIN_BUCKET))

    async def seats_holder(self, kv: KeyValue) -> str:
        """The server machine that still has extra seats (the first machine), or a refusal."""
        for node_id, record in sorted((await self.known_servers()).items()):
            if len(membership.server_names(record, node_id)) > 1:
                return node_id
        raise ZatteraError("no server machine has extra seats to retire (retired already?)")

    async def forward_to(self, kv: KeyValue, node_id: str, seats: bool) -> str:
        """The server machine that must do this removal when it is not this one ('' = this one): never the
        machine removed; for seats, the machine that has them."""
        if seats:
            return "" if node_id == self.node_id else node_id
        if node_id != self.node_id:
            return ""
        others = sorted(n for n in await self.known_servers() if n != node_id)
        return others[0] if others else ""

    async def remove(
        self, kv: KeyValue, node_id: str, now: float | None = None, *, force: bool = False
    ) -> dict[str, Any]:
        until = time.monotonic() + self.answer_within
        known = await membership.servers(kv)
        registered = await membership.node_registered(self.conn, node_id)
        if node_id not in known and not registered:
            raise ZatteraError(f"no machine named {node_id} in the cluster")
        if node_id in known and len(known) == 1:
            raise ZatteraError(f"{node_id} is the last server machine: the cluster would have none")
        names = membership.server_names(known[node_id], node_id) if node_id in known else []
        if names:
            at_step("checking that the machines left can hold every stream")
            async with self._staying(_client_urls(known, node_id)) as conn:
                await _check_copies(conn, len(known) - 1, f"removing {node_id}", force)
        at_step("revoking its credentials")
        keys = await membership.issued_keys(kv, node_id)
        keys += [str(k) for k in known.get(node_id, {}).get("users") or [] if k not in keys]
        stamp = int(now if now is not None else time.time()) + 1
        # Revoked first: the machine's services lose the cluster before its servers leave JetStream.
        revoked = await membership.add_revocations(kv, dict.fromkeys(keys, stamp))
        authority = membership.apply_revocations(self.security_dir, revoked)
        at_step("pushing the revocations to the servers")
        await membership.push_accounts(self.urls, self.system_creds, self.tls_ca, authority)
        log.info("machine %s: %d credentials revoked (the services' and system ones once answered)", node_id, len(keys))
        at_step("deleting its records")
        if node_id in known:
            await kv.delete(f"{membership.SERVER_PREFIX}{node_id}")
        for key in await membership._keys(kv):
            if key.startswith(membership.MESH_PREFIX):
                try:
                    entry = await kv.get(key)
                except KeyNotFoundError:
                    continue
                if (entry.value or b"").decode() == node_id:
                    await kv.delete(key)
        if registered:
            # The node record goes: its mesh peers drop it, nothing is placed there again.
            state = await self.conn.js.key_value(STATE_BUCKET)
            await state.delete(K.node(node_id))
        others = _client_urls(known, node_id)
        at_step(f"peer-removing its servers {', '.join(names)}" if names else "peer-removing its servers (none)")
        removed = await self._peer_remove(others, names, _server_names(known, node_id), until)
        log.info("machine %s: servers %s peer-removed; waiting for every stream's copies", node_id, removed)
        at_step("waiting for every stream's copies on the servers left")
        short = await self._wait_copies(names, others, until) if names else []
        log.info(
            "machine %s removed (peer removed: %s, %d credentials revoked, %d streams short of copies)",
            node_id,
            ", ".join(removed) or "none",
            len(keys),
            len(short),
        )
        return {
            "node_id": node_id,
            "peer_removed": bool(names) and len(removed) == len(names),
            "servers": removed,
            "revoked": keys,
            "short": short,
            "staying": others or self.urls.split(","),
        }

    async def retire_seats(self, kv: KeyValue) -> dict[str, Any]:
        """Peer-remove this (first) machine's extra seats once three server machines hold the streams, and
        record them as retired: ``zattera up`` stops them and does not start them again."""
        until = time.monotonic() + self.answer_within
        names, _, _ = self._serving()
        seats = names[1:]
        if not seats:
            raise ZatteraError(f"{self.node_id or 'this machine'} has no extra seats to retire")
        known = await self.known_servers()
        if len(known) < 3:
            raise ZatteraError(
                f"retiring {self.node_id}'s extra seats needs 3 server machines (the cluster has {len(known)}): "
                "join more with zattera nodes join-token --server"
            )
        _, own, _ = self._serving()
        kept = [*_client_urls(known, self.node_id), *own.split(",")[:1]]  # the first seat stays
        at_step("checking that three server machines hold every stream")
        async with self._staying(kept) as conn:  # this service's own connection may be on a seat
            await _check_copies(conn, len(known), f"retiring {self.node_id}'s extra seats", force=False, at_least=3)
        at_step(f"peer-removing the seats {', '.join(seats)}")
        removed = await self._peer_remove(kept, seats, [*_server_names(known, self.node_id), names[0]], until)
        log.info("seats %s of %s peer-removed", ", ".join(removed), self.node_id)
        assert self.control_dir is not None
        marker = self.control_dir / RETIRED_SEATS_FILE
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(sorted({*self.retired_seats(), *seats})))
        names, client_url, route_url = self._serving()
        users = membership.local_users(self.security_dir)
        at_step("rewriting this machine's record and waiting for every stream's copies")
        async with self._staying(kept) as conn:  # this service's own connection may be on a seat

            async def rewrite() -> None:  # the bucket's stream may be electing a leader (its copy on a seat went)
                staying_kv = await conn.js.key_value(JOIN_BUCKET)
                await membership.register_server(staying_kv, self.node_id, client_url, route_url, names, users)

            deadline = min(time.monotonic() + self.streams_wait, until)
            await _answered(rewrite, deadline, f"the record of {self.node_id} could not be rewritten")
            short = await self._copies_back(conn, seats, until)
        log.info("seats %s of %s retired (%d streams short of copies)", ", ".join(seats), self.node_id, len(short))
        return {"node_id": self.node_id, "servers": removed, "retired": seats, "short": short}

    async def _peer_remove(self, urls: list[str], names: list[str], staying: list[str], until: float) -> list[str]:
        """Peer-remove ``names`` through the servers that stay (``urls``, named ``staying``), one at a time: the
        meta leadership moved to a server that stays first (:func:`membership.lead_elsewhere`); before the next,
        the meta group answers again (a leader among those left) and every copy has left the servers removed so
        far (a copy that moved from one seat onto the next must move again, and one removed mid-move may stay
        listed on it); the names removed."""
        removed = []
        for index, name in enumerate(names):
            if index:
                async with self._staying(urls) as conn:
                    await _meta_answers(conn, _left(until, self.streams_wait))
                    await self._copies_back(conn, names[:index], until)
            lead_wait = _left(until, membership.LEAD_WAIT)
            if await membership.peer_remove(
                ",".join(urls), self.system_creds, self.tls_ca, name, staying=staying, lead_wait=lead_wait
            ):
                removed.append(name)
        return removed

    async def _wait_copies(self, gone: list[str], urls: list[str], until: float) -> list[dict[str, Any]]:
        """Wait until no stream has a copy on ``gone`` and each is at its replica count, caught up; returns the
        streams that are not after :attr:`streams_wait` (copies the remaining servers cannot hold). Asked
        through the servers that stay (``urls``): a removed server has disabled its JetStream, and a client on
        it gets no JetStream answer until it reconnects elsewhere."""
        async with self._staying(urls) as conn:
            return await self._copies_back(conn, gone, until)

    @contextlib.asynccontextmanager
    async def _staying(self, urls: list[str]) -> AsyncIterator[Connection]:
        """A control connection of its own to the servers that stay (the service's connection may be on a server
        removed, whose JetStream is disabled, or reconnecting)."""
        tls_ca = self.tls_ca or None
        conn = await connect(",".join(urls), name="zattera-removal", creds=self.control_creds, tls_ca=tls_ca)
        try:
            yield conn
        finally:
            await conn.close()

    async def _copies_back(self, conn: Connection, gone: list[str], until: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + _left(until, self.streams_wait)

        async def streams() -> list[dict[str, Any]]:  # several JetStream requests: cut at the deadline
            answer = await asyncio.wait_for(plan(conn.nc), max(1.0, deadline - time.monotonic()))
            found: list[dict[str, Any]] = answer["streams"]
            return found

        while True:
            answered = await _answered(streams, deadline, "JetStream did not answer for its streams' copies")
            short = [
                {"stream": s["stream"], "replicas": s["replicas"], "current": s["current"], "servers": s["servers"]}
                for s in answered
                if set(s["servers"]) & set(gone)
                or len(s["servers"]) != s["replicas"]
                or s["current"] != s["replicas"]
                or not s["leader"]
            ]
            if not short or time.monotonic() > deadline:
                return short
            await asyncio.sleep(0.25)


def _left(until: float, at_most: float) -> float:
    """Seconds left before ``until`` (monotonic), at most ``at_most``, at least a second."""
    return max(1.0, min(at_most, until - time.monotonic()))


def _server_names(known: dict[str, dict[str, Any]], but: str) -> list[str]:
    """The NATS server names of every server machine but ``but``."""
    return [n for node, r in sorted(known.items()) if node != but for n in membership.server_names(r, node)]


def _client_urls(known: dict[str, dict[str, Any]], but: str) -> list[str]:
    """The client URLs of every server machine but ``but``."""
    return [u for n, r in known.items() if n != but for u in str(r.get("client_url", "")).split(",") if u]


async def _check_copies(conn: Connection, machines: int, doing: str, force: bool, at_least: int = 0) -> None:
    """Refuse (unless ``force``) when the server machines left cannot hold a copy of every stream each
    (``at_least``: the streams must be at that many copies already)."""
    streams = (await plan(conn.nc))["streams"]
    highest = max((int(s["replicas"]) for s in streams), default=1)
    if at_least and highest < at_least:
        raise ZatteraError(f"{doing}: streams have {highest} copies; run zattera cluster replicas 3 first")
    if machines < highest and not force:
        raise ZatteraError(
            f"{doing} would leave {machines} server machine(s) for streams of {highest} copies: join another "
            "server machine first (zattera nodes join-token --server), or lower the copies (zattera cluster "
            "replicas 1), or --force to remove it anyway"
        )


async def _meta_answers(conn: Connection, wait: float) -> None:
    """Wait (at most ``wait`` s) until the JetStream meta leader answers (``STREAM.NAMES``)."""
    await _answered(
        lambda: js_api(conn.nc, "STREAM.NAMES", {"offset": 0}),
        time.monotonic() + wait,
        f"the JetStream meta group did not answer within {wait:.0f} s",
    )


async def _answered(ask: Callable[[], Awaitable[T]], deadline: float, failed: str) -> T:
    """What ``ask`` returns once NATS answers it: asked again every 0.25 s while it does not (a stream or the
    meta group electing a leader), until ``deadline`` (monotonic), then :class:`ZatteraError` ``failed: why``."""
    while True:
        try:
            return await ask()
        except (TimeoutError, NatsError) as exc:
            log.info("not answered yet (%s): asked again", exc)
            if time.monotonic() > deadline:
                raise ZatteraError(f"{failed}: {exc}") from None
            await asyncio.sleep(0.25)
