"""Which leader loops each service runs, and who holds their leases (read from the state stream)."""

from __future__ import annotations

from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection
from shared.subjects import STATE_PREFIX, STATE_STREAM

LOOPS_OF = {
    "scheduler": {"scheduler", "liveness", "snapshots"},
    "orchestrator": {"orchestrator"},
    "autoscale": {"autoscaler", "scaletozero", "serverless", "metrics-history"},
    "builds": {"builds", "retention"},
    "routes": {"vips"},
    "join": set(),
    "secrets": {"secrets-gc", "backups", "snapshot-offsite", "notify"},
    "certs": {"certs"},
    "console": set(),
}
"""Each service's leader loops (the names of their leases)."""
LOOPS_OF["allinone"] = set().union(*LOOPS_OF.values())
SERVICE_OF_LOOP = {loop: service for service, loops in LOOPS_OF.items() if service != "allinone" for loop in loops}


async def lease_holders(conn: Connection, loops: set[str]) -> dict[str, str]:
    """The holder of each loop among ``loops`` whose lease key currently holds a lease (a released one is
    deleted)."""
    holders = {}
    for loop in loops:
        try:
            msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.lease(loop))
        except NotFoundError:
            continue
        if msg.data:
            holders[loop] = pb.Lease.FromString(msg.data).holder
    return holders


async def held_leases(conn: Connection, loops: set[str]) -> set[str]:
    return set(await lease_holders(conn, loops))
