"""A relayed write that no stream leader takes (the state stream electing one after a machine loss) is
answered at once with a 503 — nothing was stored — so the writer sends it again instead of waiting out its
timeout. Real nats-server without the state stream: nobody takes the relayed write."""

from __future__ import annotations

import json

from shared.connection import connect
from shared.embedded import EmbeddedNats
from shared.security.accounts import RELAY_PREFIX
from shared.security.relay import relay_handler
from shared.subjects import STATE_PREFIX

AGENTS = "AGENTS-ACCOUNT"


async def test_a_relayed_write_no_leader_takes_is_answered_503_at_once(nats_server: EmbeddedNats) -> None:
    conn = await connect(nats_server.url, name="relay")
    try:
        await conn.nc.subscribe(f"{RELAY_PREFIX}>", queue="relay", cb=relay_handler(conn, AGENTS))
        info = json.dumps({"acc": AGENTS, "name_tag": "n1"})  # what an import sets: an agent of node n1
        reply = await conn.nc.request(
            f"{RELAY_PREFIX}{STATE_PREFIX}observed.n1.a1",
            b"x",
            timeout=2,
            headers={"Nats-Request-Info": info, "Nats-Expected-Last-Subject-Sequence": "0"},
        )
        assert json.loads(reply.data)["error"]["code"] == 503
    finally:
        await conn.close()
