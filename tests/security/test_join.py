"""Node join: a token is exchanged once for a node credential; used, expired or misbound tokens are refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from shared.connection import Connection, connect
from shared.security.creds import read_user_jwt, write_private
from shared.security.join import JoinRefused, JoinService, JoinToken
from shared.security.join_client import join, request_join_token
from shared.security.nkeyjwt import decode_claims
from shared.subjects import STATE_PREFIX
from tests.security.conftest import ManualClock, SecureCluster

CLUSTER_TOO = True  # also against a secured three-server cluster (conftest.py)


async def test_a_join_token_works_once(
    secure: SecureCluster, join_service: JoinService, operator: Connection, tmp_path: Path
) -> None:
    token = await request_join_token(operator, ttl=600)

    creds = write_private(tmp_path / "node.creds", await join(secure.url, token, "fresh-node"))
    agent = await connect(secure.url, name="agent", creds=str(creds))
    try:
        ack = await agent.js.publish(f"{STATE_PREFIX}observed.fresh-node.a1", b"running")
        assert ack.seq > 0
    finally:
        await agent.close()

    with pytest.raises(JoinRefused, match=r"join token already used \(node fresh-node joined with it"):
        await join(secure.url, token, "fresh-node")
    with pytest.raises(JoinRefused, match="already used"):
        await join(secure.url, token, "another-node")


async def test_an_expired_join_token_is_refused(
    secure: SecureCluster, join_service: JoinService, operator: Connection, clock: ManualClock
) -> None:
    token = await request_join_token(operator, ttl=60)
    clock.now += 61
    with pytest.raises(JoinRefused, match=r"join token expired at .*; ask for a new one"):
        await join(secure.url, token, "late-node")


async def test_a_token_bound_to_a_node_joins_only_that_node(
    secure: SecureCluster, join_service: JoinService, operator: Connection, control: Connection, tmp_path: Path
) -> None:
    token = await request_join_token(operator, ttl=600, node_id="bound-node")
    with pytest.raises(JoinRefused, match="this join token is for node bound-node, not intruder"):
        await join(secure.url, token, "intruder")

    # An unbound token cannot take over the identity of a registered node.
    await control.js.publish(f"{STATE_PREFIX}node.existing", b"registered")
    unbound = await request_join_token(operator, ttl=600)
    with pytest.raises(JoinRefused, match="a machine named existing is already in the cluster"):
        await join(secure.url, unbound, "existing")
    creds = write_private(tmp_path / "bound.creds", await join(secure.url, token, "bound-node"))
    assert decode_claims(read_user_jwt(creds))["name"] == "bound-node"


async def test_unknown_and_malformed_tokens_are_refused(secure: SecureCluster, join_service: JoinService) -> None:
    with pytest.raises(JoinRefused, match="malformed join token"):
        await join(secure.url, "not-a-token", "n9")
    forged = JoinToken("0" * 52, secure.setup.sentinel_jwt())
    with pytest.raises(JoinRefused, match="unknown join token"):
        await join(secure.url, str(forged), "n9")


async def test_the_join_sentinel_reaches_nothing_but_the_join_service(secure: SecureCluster) -> None:
    errors: list[str] = []

    async def record(exc: Exception) -> None:
        errors.append(str(exc))

    sentinel = secure.setup.sentinel_jwt()
    nc = await nats.connect(
        secure.url,
        user_jwt_cb=lambda: sentinel.encode(),
        signature_cb=lambda _nonce: b"",
        error_cb=record,
        allow_reconnect=False,
    )
    try:
        await nc.publish(f"{STATE_PREFIX}env.e1", b"forged")
        await nc.flush()
        await asyncio.sleep(0.1)
        assert errors == [f'nats: permissions violation for publish to "{STATE_PREFIX.lower()}env.e1"']
    finally:
        await nc.close()
