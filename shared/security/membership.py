"""The machines of a cluster as the join service keeps them: server machines, mesh addresses, removal.

Records in the ``zattera-join`` bucket (control only):

- ``server.<node>``: ``{"client_url", "route_url", "names", "users"}`` of a server machine, written by that
  machine's own join service at start; a machine token names every server's client URL, a joining server
  routes to all; ``names``: its NATS servers' names (the first machine's seats too), which a removal
  peer-removes; ``users``: the public keys of the credentials the machine made itself from the trust root
  (control, operator, system), which a removal revokes;
- ``meship.<a>-<b>``: ``<node>``: the mesh address ``10.98.a.b`` taken by a node, created (never updated),
  so two joins cannot take one address;
- ``revocations``: ``{user public key: epoch seconds}``: every credential revoked, the cluster's record
  (each server's account JWTs are re-signed from it).

Removing a machine (:meth:`shared.security.machine_service.Machines.remove`): every credential issued to it
by a join, or made on it, is revoked — the account JWTs re-signed with the revocation and pushed to
the servers (``$SYS.REQ.CLAIMS.UPDATE``, the full resolver: every server applies it at once, no restart) —
and its records go; then its NATS servers are peer-removed from JetStream (the meta leader places their
stream copies on other servers) and the removal waits until every stream is back at its replica count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import keys as K
from shared.connection import Connection, connect
from shared.errors import ZatteraError
from shared.jetstream import is_delete_marker
from shared.security.accounts import ROLE_ACCOUNTS, Account
from shared.security.authority import Authority
from shared.security.creds import read_user_jwt
from shared.security.nkeyjwt import decode_claims
from shared.security.removal_answers import REMOVAL_PREFIX
from shared.subjects import STATE_PREFIX, STATE_STREAM

log = logging.getLogger(__name__)

MESH_NETWORK = "10.98"
"""Mesh addresses are ``10.98.a.b`` (/16): one per node, on its WireGuard interface."""
REVOCATIONS_KEY = "revocations"
SERVER_PREFIX = "server."
MESH_PREFIX = "meship."
JSZ_PING = "$SYS.REQ.SERVER.PING.JSZ"
META_STEPDOWN = "$JS.API.META.LEADER.STEPDOWN"
LEAD_WAIT = 30.0
"""How long a removal waits for JetStream's meta leadership to leave the server it removes."""


class RemoveRefused(ZatteraError):
    """The machine cannot be removed as asked (unknown node, the last server)."""


async def register_server(
    kv: KeyValue,
    node_id: str,
    client_url: str,
    route_url: str,
    names: list[str] | None = None,
    users: list[str] | None = None,
) -> None:
    record: dict[str, Any] = {"client_url": client_url, "route_url": route_url}
    if names:
        record["names"] = names
    if users:
        record["users"] = users
    await kv.put(f"{SERVER_PREFIX}{node_id}", json.dumps(record).encode())


def server_names(record: dict[str, Any], node_id: str) -> list[str]:
    """The NATS server names of a server machine (a record written before they were recorded: its node id)."""
    names = record.get("names")
    return [str(n) for n in names] if isinstance(names, list) and names else [node_id]


def local_users(security_dir: Path) -> list[str]:
    """The public keys of the credentials a server machine made itself from the trust root (``prepare``):
    control, operator, system. Revoked with the machine."""
    found = []
    for name in ("control", "operator", "system"):
        path = security_dir / "creds" / f"{name}.creds"
        if path.exists():
            subject = decode_claims(read_user_jwt(path)).get("sub")
            if subject:
                found.append(str(subject))
    return found


async def servers(kv: KeyValue) -> dict[str, dict[str, Any]]:
    """Every registered server machine: node id → its record (URLs, server names, users)."""
    return {node_id: json.loads(value) async for node_id, value in _entries(kv, SERVER_PREFIX) if value}


async def _entries(kv: KeyValue, prefix: str) -> AsyncIterator[tuple[str, bytes]]:
    """(the key after ``prefix``, its value) of every key of the bucket under ``prefix``, but those deleted
    since they were listed."""
    for key in await _keys(kv):
        if key.startswith(prefix):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            yield key.removeprefix(prefix), entry.value or b""


async def _keys(kv: KeyValue) -> list[str]:
    """Every key of the bucket, as its stream lists its subjects (one ``STREAM.INFO`` the server answers
    whole). Not ``kv.keys()``: nats-py's watcher may signal "no more keys" before the first one it already
    received is handled (a loaded machine), and an empty list here made a joining server machine believe
    there was no cluster to join: it started one of its own."""
    prefix = f"$KV.{kv._name}."
    info = await kv._js.stream_info(f"KV_{kv._name}", subjects_filter=f"{prefix}>")
    return sorted(subject.removeprefix(prefix) for subject in (info.state.subjects or {}))


async def mesh_ip(kv: KeyValue, node_id: str) -> str:
    """The node's mesh address: the one it holds, else the lowest free one (taken by a KV create)."""
    taken: set[str] = set()
    async for suffix, value in _entries(kv, MESH_PREFIX):
        address = f"{MESH_NETWORK}.{suffix.replace('-', '.')}"
        if value.decode() == node_id:
            return address
        taken.add(address)
    for index in range(1, 254 * 254):
        a, b = divmod(index, 254)
        address = f"{MESH_NETWORK}.{a}.{b + 1}"
        if address in taken or b + 1 == 255:
            continue
        try:
            await kv.create(f"{MESH_PREFIX}{a}-{b + 1}", node_id.encode())
        except KeyWrongLastSequenceError:
            continue  # taken meanwhile by another join
        except nats.js.errors.BadRequestError:
            continue
        return address
    raise ZatteraError("no free mesh address left in 10.98.0.0/16")


async def claim_mesh_ip(kv: KeyValue, node_id: str, address: str) -> None:
    """Record ``address`` as ``node_id``'s (the first server machine's, fixed before anyone joins)."""
    a, b = address.split(".")[2:]
    try:
        await kv.create(f"{MESH_PREFIX}{a}-{b}", node_id.encode())
    except (KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
        entry = await kv.get(f"{MESH_PREFIX}{a}-{b}")
        if (entry.value or b"").decode() != node_id:
            log.error("mesh address %s is taken by %s", address, (entry.value or b"").decode())


async def revocations(kv: KeyValue) -> dict[str, int]:
    try:
        entry = await kv.get(REVOCATIONS_KEY)
    except KeyNotFoundError:
        return {}
    return {str(k): int(v) for k, v in json.loads(entry.value or b"{}").items()}


async def add_revocations(kv: KeyValue, keys: dict[str, int]) -> dict[str, int]:
    """Record ``keys`` as revoked (compare-and-set: concurrent removals both land); returns the whole set."""
    while True:
        try:
            entry = await kv.get(REVOCATIONS_KEY)
            current = json.loads(entry.value or b"{}")
            revision = entry.revision
        except KeyNotFoundError:
            current, revision = {}, 0
        merged = {**current, **keys}
        try:
            if revision:
                await kv.update(REVOCATIONS_KEY, json.dumps(merged).encode(), last=revision)
            else:
                await kv.create(REVOCATIONS_KEY, json.dumps(merged).encode())
            return {str(k): int(v) for k, v in merged.items()}
        except (KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue


async def issued_keys(kv: KeyValue, node_id: str) -> list[str]:
    """The user public keys the join service issued credentials for to ``node_id`` (from the used tokens)."""
    found: list[str] = []
    for key in await _keys(kv):
        if key.startswith((SERVER_PREFIX, MESH_PREFIX, REMOVAL_PREFIX)) or key == REVOCATIONS_KEY:
            continue
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        record = json.loads(entry.value or b"{}")
        if record.get("used_by") == node_id:
            found += [str(record[k]) for k in ("public_key", "proxy_public_key") if record.get(k)]
    return found


def apply_revocations(security_dir: Path, revoked: dict[str, int]) -> Authority:
    """This machine's account JWTs re-signed with every revocation of the cluster (its files rewritten, so a
    restart of its server keeps them)."""
    authority = Authority.load(security_dir)
    authority.revocations.update(revoked)
    authority.save(security_dir)
    return authority


async def push_accounts(
    urls: str, system_creds: str, tls_ca: str, authority: Authority, *, control: bool = False
) -> None:
    """Send the role accounts' JWTs to the servers (system account): the full resolver applies them at once on
    every server of the cluster. ``control``: instead, ``ZATTERA``'s (whose users are the services) and the
    system account's — sent only after the removal's answer: an update of ``ZATTERA`` drops the reply
    mappings of the requests in flight into it (nats-server rebuilds its exports), that answer's included."""
    conn = await connect(urls, name="zattera-accounts", creds=system_creds, tls_ca=tls_ca or None)
    try:
        if control:
            jwts = {str(Account.ZATTERA): authority.zattera_account_jwt(), "system": authority.system_account_jwt()}
        else:
            jwts = {str(a): authority.role_account_jwt(a) for a in ROLE_ACCOUNTS}
        for account, jwt in jwts.items():
            reply = await conn.nc.request("$SYS.REQ.CLAIMS.UPDATE", jwt.encode(), timeout=5)
            answer = json.loads(reply.data or b"{}")
            if answer.get("error"):
                raise ZatteraError(f"the servers refused the {account} account update: {answer['error']}")
    finally:
        await conn.close()


async def meta_leader(nc: NATS, timeout: float = 2.0) -> str:
    """The name of the server leading JetStream's meta group ('' while there is none); system account."""
    try:
        msg = await nc.request(JSZ_PING, json.dumps({"leader_only": True}).encode(), timeout=timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return ""
    return str((json.loads(msg.data or b"{}").get("server") or {}).get("name") or "")


async def lead_elsewhere(nc: NATS, leaving: str, staying: Sequence[str], wait: float = LEAD_WAIT) -> str:
    """Move JetStream's meta leadership off ``leaving`` (onto one of ``staying``, each in turn) before it is
    peer-removed, and wait for a leader elsewhere; its name ('' when none came within ``wait``: the removal
    goes on, as it did before). A meta leader that is peer-removed steps down and stops its meta group but
    keeps JetStream on: until that server stops, it answers every request for the cluster's streams at once
    with "JetStream system temporarily unavailable" (nats-server 2.15), first of all servers, so the removal
    could never see the copies back."""
    deadline = time.monotonic() + wait
    turn = 0
    while True:
        leader = await meta_leader(nc)
        if leader and leader != leaving:
            return leader
        if time.monotonic() > deadline:
            log.warning("JetStream's meta leadership did not leave %s within %.0f s", leaving, wait)
            return ""
        if leader == leaving and staying:
            name = staying[turn % len(staying)]
            turn += 1
            body = json.dumps({"placement": {"preferred": name}}).encode()
            try:
                answer = json.loads((await nc.request(META_STEPDOWN, body, timeout=5)).data or b"{}")
            except nats.errors.TimeoutError:
                answer = {"error": "no answer"}
            if answer.get("success"):
                log.info("meta leadership handed from %s to %s before its removal", leaving, name)
            else:
                log.info("meta leadership not handed from %s to %s: %s", leaving, name, answer.get("error"))
        await asyncio.sleep(0.25)


async def peer_remove(
    urls: str,
    system_creds: str,
    tls_ca: str,
    server_name: str,
    attempts: int = 4,
    staying: Sequence[str] = (),
    lead_wait: float = LEAD_WAIT,
) -> bool:
    """Remove a server from the JetStream meta group (its streams' replicas are placed elsewhere). Asked again
    when unanswered (the meta group may be electing a leader: a request then gets no answer); a refusal after
    an unanswered attempt means that attempt landed (the server is no peer any more). ``staying``: the servers
    that stay, where the meta leadership is moved first when the server removed has it (:func:`lead_elsewhere`)."""
    conn = await connect(urls, name="zattera-peer-remove", creds=system_creds, tls_ca=tls_ca or None)
    body = json.dumps({"peer": server_name}).encode()
    unanswered = False
    try:
        if staying:
            await lead_elsewhere(conn.nc, server_name, staying, lead_wait)
        for attempt in range(attempts):
            try:
                reply = await conn.nc.request("$JS.API.SERVER.REMOVE", body, timeout=5)
                break
            except nats.errors.TimeoutError:
                unanswered = True
                log.info("peer-remove of %s: no answer (attempt %d)", server_name, attempt + 1)
        else:
            raise ZatteraError(f"JetStream did not answer the removal of server {server_name}")
    finally:
        await conn.close()
    answer: dict[str, Any] = json.loads(reply.data or b"{}")
    if answer.get("error"):
        log.warning("peer-remove of %s: %s", server_name, answer["error"])
        return unanswered
    return bool(answer.get("success"))


async def node_registered(conn: Connection, node_id: str) -> bool:
    try:
        msg = await conn.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}{K.node(node_id)}", direct=True)
    except nats.js.errors.NotFoundError:
        return False
    return not is_delete_marker(msg.headers)
