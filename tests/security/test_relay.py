"""Agents' state writes go through the relay: stored with the headers a key write needs, never a rollup."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.js.errors import APIError, NotFoundError

from shared.connection import Connection, connect
from shared.ids import new_id
from shared.security.authority import RoleIssuer
from shared.security.join import JoinService
from shared.security.permissions import Role
from shared.security.relay import relayed_write
from shared.subjects import LIVE_PREFIX, LIVE_STREAM, STATE_PREFIX, STATE_STREAM
from tests.security.conftest import SecureCluster

NODE = "relayed"


async def test_an_agents_rollup_is_stripped_and_every_other_key_stays(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    others = [f"{STATE_PREFIX}assignment.n2.keep", f"{STATE_PREFIX}lease.scheduler-x", f"{STATE_PREFIX}env.keep"]
    for subject in others:
        await control.js.publish(subject, b"intact")
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        own = f"{STATE_PREFIX}observed.{NODE}.a1"
        for rollup in ("all", "sub"):
            ack = await agent.js.publish(own, f"rollup {rollup}".encode(), headers={"Nats-Rollup": rollup})
            assert ack.stream == STATE_STREAM
        assert (await control.js.get_last_msg(STATE_STREAM, own)).data == b"rollup sub"
        for subject in others:
            assert (await control.js.get_last_msg(STATE_STREAM, subject)).data == b"intact"
    finally:
        await agent.close()


async def test_an_agents_atomic_batch_and_compare_and_set_pass_the_relay(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        batch, first, second = new_id(), f"{STATE_PREFIX}observed.{NODE}.b1", f"{STATE_PREFIX}observed.{NODE}.b2"
        await agent.nc.publish(first, b"one", headers={"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1"})
        commit = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
        reply = json.loads((await agent.nc.request(second, b"two", headers=commit, timeout=5)).data)
        assert reply.get("count") == 2, reply
        assert (await control.js.get_last_msg(STATE_STREAM, first)).data == b"one"

        stale = {"Nats-Expected-Last-Subject-Sequence": "1"}
        refused = json.loads((await agent.nc.request(first, b"stale", headers=stale, timeout=5)).data)
        assert refused["error"]["err_code"] == 10071  # wrong last sequence: the stream's own answer
    finally:
        await agent.close()


@pytest.mark.parametrize(
    ("subject", "headers", "refusal"),
    [
        (f"{STATE_PREFIX}observed.n2.a1", {}, "not a key of node n1"),
        (f"{STATE_PREFIX}node.n2", {}, "not a key of node n1"),
        (f"{STATE_PREFIX}observed.n1.a1", {"KV-Operation": "PURGE"}, "only DEL"),
        ("$KV.zattera-live.node.n1", {}, "not a state key"),
        (f"{STATE_PREFIX}lease.scheduler", {}, "leases are written by the services only"),
    ],
)
def test_the_relay_refuses_what_is_not_the_callers_key_write(
    subject: str, headers: dict[str, str], refusal: str
) -> None:
    outcome = relayed_write("zattera.relay." + subject, headers, "n1")
    assert isinstance(outcome, str) and refusal in outcome


def test_an_operator_may_write_any_nodes_keys_but_no_lease() -> None:
    assert relayed_write(f"zattera.relay.{STATE_PREFIX}node.n2", {}, "cli", agent=False) == (
        f"{STATE_PREFIX}node.n2",
        {},
    )
    refused = relayed_write(f"zattera.relay.{STATE_PREFIX}lease.x", {}, "cli", agent=False)
    assert isinstance(refused, str) and "leases" in refused


async def test_an_operators_rollup_is_stripped_and_its_batches_pass(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    keep = f"{STATE_PREFIX}assignment.n2.operator-keep"
    await control.js.publish(keep, b"intact")
    operator = await connect(secure.url, name="cli", creds=str(secure.setup.operator_creds))
    try:
        own = f"{STATE_PREFIX}env.operator-rollup"
        ack = await operator.js.publish(own, b"desired", headers={"Nats-Rollup": "all"})
        assert ack.stream == STATE_STREAM
        assert (await control.js.get_last_msg(STATE_STREAM, keep)).data == b"intact"
        batch = new_id()
        first, second = f"{STATE_PREFIX}env.op-b1", f"{STATE_PREFIX}env.op-b2"
        await operator.nc.publish(first, b"one", headers={"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1"})
        commit = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
        reply = json.loads((await operator.nc.request(second, b"two", headers=commit, timeout=5)).data)
        assert reply.get("count") == 2, reply
    finally:
        await operator.close()


def test_the_relay_keeps_only_the_headers_of_a_key_write() -> None:
    headers = {"Nats-Rollup": "all", "Nats-Expected-Last-Subject-Sequence": "3", "Nats-Expected-Stream": "x"}
    outcome = relayed_write(f"zattera.relay.{STATE_PREFIX}observed.n1.a1", headers, "n1")
    assert outcome == (f"{STATE_PREFIX}observed.n1.a1", {"Nats-Expected-Last-Subject-Sequence": "3"})


async def test_nothing_is_stored_for_a_write_nobody_relays(secure: SecureCluster, control: Connection) -> None:
    """Without the relay (join service down) an agent's write is not stored at all — never bypasses it."""
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        with pytest.raises(Exception):  # noqa: B017 - no responders or a timeout, depending on timing
            await agent.js.publish(f"{STATE_PREFIX}observed.{NODE}.unrelayed", b"x", timeout=1)
        with pytest.raises(NotFoundError):
            await control.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}observed.{NODE}.unrelayed")
    finally:
        await agent.close()


@pytest.mark.parametrize(("role", "name", "own"), [(Role.PROXY, "p1", "proxy.p1"), (Role.AGENT, NODE, f"node.{NODE}")])
async def test_a_rollup_on_the_live_bucket_is_refused_and_every_other_key_stays(
    secure: SecureCluster, control: Connection, role: Role, name: str, own: str
) -> None:
    other = f"{LIVE_PREFIX}node.someone-else"
    await control.js.publish(other, b"intact", stream=LIVE_STREAM)
    client = await connect(secure.url, name="live-writer", creds=secure.creds(role, name))
    try:
        with pytest.raises(APIError) as refused:
            await client.js.publish(f"{LIVE_PREFIX}{own}", b"x", headers={"Nats-Rollup": "all"})
        assert refused.value.err_code == 10111  # rollups not permitted on this stream
        assert (await control.js.get_last_msg(LIVE_STREAM, other)).data == b"intact"
    finally:
        await client.close()


async def test_a_write_without_caller_identity_is_refused(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    """A message on the relay's subject that crossed no import (published inside ZATTERA, or steered there)
    carries no ``Nats-Request-Info``: the relay refuses it instead of treating it as an agent's."""
    key = f"{STATE_PREFIX}env.no-caller"
    for subject in (key, f"{STATE_PREFIX}assignment.n2.no-caller"):
        reply = await control.nc.request(f"zattera.relay.{subject}", b"forged", timeout=5)
        assert "no caller identity" in json.loads(reply.data)["error"]["description"]
    await control.nc.publish(f"zattera.relay.{key}", b"fire and forget")  # no reply: dropped as well
    await control.nc.flush()
    probe = f"{STATE_PREFIX}observed.{NODE}.after-no-caller"  # a relayed write after it: the relay went on
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        await agent.js.publish(probe, b"relayed")
    finally:
        await agent.close()
    for subject in (key, f"{STATE_PREFIX}assignment.n2.no-caller"):
        with pytest.raises(NotFoundError):
            await control.js.get_last_msg(STATE_STREAM, subject)


async def test_a_batch_spread_over_several_relays_lands_whole(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    """Every join service relays (one queue group): a batch's messages reach different relays, and the one that
    gets the commit publishes the whole batch in order."""
    directory = secure.setup.directory
    issuers = {role: RoleIssuer.load(directory, role) for role in (Role.AGENT, Role.BUILDER)}
    others = [await connect(secure.url, name=f"control-{i}", creds=str(secure.setup.control_creds)) for i in range(2)]
    services = [JoinService(conn, issuers, secure.setup.sentinel_jwt()) for conn in others]
    tasks = [asyncio.create_task(service.run()) for service in services]
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        for service in services:
            await asyncio.wait_for(service.ready.wait(), 10)
        for round_ in range(20):
            batch, size = new_id(), 12
            keys = [f"{STATE_PREFIX}observed.{NODE}.spread{round_}-{i}" for i in range(size)]
            for seq, key in enumerate(keys[:-1], start=1):
                headers = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(seq)}
                await agent.nc.publish(key, f"{round_}.{seq}".encode(), headers=headers)
            commit = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(size), "Nats-Batch-Commit": "1"}
            reply = json.loads((await agent.nc.request(keys[-1], b"last", headers=commit, timeout=10)).data)
            assert reply.get("count") == size, (round_, reply)
            for seq, key in enumerate(keys[:-1], start=1):
                assert (await control.js.get_last_msg(STATE_STREAM, key)).data == f"{round_}.{seq}".encode()
    finally:
        await agent.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in others:
            await conn.close()
