"""The join service's part in machines joining and leaving (:mod:`shared.security.membership` holds the
records): machine tokens name the cluster's servers and CA, a join gets a mesh address and the routes of
every server, a removal peer-removes and revokes. Runs on server machines, with the control credential and
the machine's security directory (the operator and account keys sign revocations; the system credential
pushes them and asks JetStream to remove a peer)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared import keys as K
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.security import membership
from shared.security.machines import MachineToken
from shared.subjects import STATE_BUCKET

log = logging.getLogger(__name__)


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
    ca_pem: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.ca_pem = Path(self.tls_ca).read_text() if self.tls_ca else ""

    @property
    def system_creds(self) -> str:
        return str(self.security_dir / "creds" / "system.creds")

    async def started(self, kv: KeyValue) -> None:
        """Register this server machine; bring this machine's account JWTs up to the cluster's revocations."""
        if self.node_id and self.client_url:
            await membership.register_server(kv, self.node_id, self.client_url, self.route_url)
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

    async def remove(self, kv: KeyValue, node_id: str, now: float | None = None) -> dict[str, Any]:
        known = await membership.servers(kv)
        registered = await membership.node_registered(self.conn, node_id)
        if node_id not in known and not registered:
            raise ZatteraError(f"no machine named {node_id} in the cluster")
        if node_id in known and len(known) == 1:
            raise ZatteraError(f"{node_id} is the last server machine: the cluster would have none")
        peer_removed = False
        if node_id in known:
            peer_removed = await membership.peer_remove(self.urls, self.system_creds, self.tls_ca, node_id)
            await kv.delete(f"{membership.SERVER_PREFIX}{node_id}")
        keys = await membership.issued_keys(kv, node_id)
        stamp = int(now if now is not None else time.time()) + 1
        revoked = await membership.add_revocations(kv, dict.fromkeys(keys, stamp))
        authority = membership.apply_revocations(self.security_dir, revoked)
        await membership.push_accounts(self.urls, self.system_creds, self.tls_ca, authority)
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
        log.info("machine %s removed (peer removed: %s, %d credentials revoked)", node_id, peer_removed, len(keys))
        return {"node_id": node_id, "peer_removed": peer_removed, "revoked": keys}
