"""Each role's rights, checked against a real nats-server: every refusal is the server's own answer."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
import pytest

from shared.connection import Connection, connect
from shared.secrets import ROTATE_SUBJECT, open_subject
from shared.security.join import JoinService
from shared.security.permissions import Role
from shared.subjects import (
    LEASE_PROBE_PREFIX,
    LIVE_PREFIX,
    ROUTES_SNAPSHOT_SUBJECT,
    STATE_PREFIX,
    STATE_STREAM,
    agent_subject,
)
from tests.security.conftest import ConnectAs, SecureCluster, answered_request

CLUSTER_TOO = True  # also against a secured three-server cluster (conftest.py)

NODE = "n1"


def publish_refused(subject: str) -> str:
    return f'nats: permissions violation for publish to "{subject.lower()}"'


async def test_unauthenticated_client_is_refused(secure: SecureCluster) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(secure.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


async def test_agent_writes_its_own_observed_key_and_reads_its_assignments(
    secure: SecureCluster, control: Connection, join_service: JoinService
) -> None:
    await control.js.publish(f"{STATE_PREFIX}assignment.{NODE}.a1", b"desired-1")
    await control.js.publish(f"{STATE_PREFIX}assignment.n2.a2", b"not yours")
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        ack = await agent.js.publish(f"{STATE_PREFIX}observed.{NODE}.a1", b"running")
        assert ack.stream == STATE_STREAM
        await agent.js.publish(f"{LIVE_PREFIX}node.{NODE}", b"heartbeat")

        got = await agent.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}assignment.{NODE}.a1", direct=True)
        assert got.data == b"desired-1"

    finally:
        await agent.close()


@pytest.mark.parametrize(
    "subject",
    [
        f"{STATE_PREFIX}observed.n2.a2",  # another node's observed state
        f"{STATE_PREFIX}assignment.{NODE}.a1",  # desired state, even its own
        f"{STATE_PREFIX}env.e1",
        f"{STATE_PREFIX}lease.scheduler",
        f"{STATE_PREFIX}release.r1",  # it reads releases and volumes, never writes them
        f"{STATE_PREFIX}volume.v1",
        f"{STATE_PREFIX}image.i1",  # image tags: builders only
        f"{STATE_PREFIX}node.n2",
        f"{LIVE_PREFIX}node.n2",
        ROUTES_SNAPSHOT_SUBJECT,
    ],
)
async def test_agent_cannot_write_anything_else(connect_as: ConnectAs, subject: str) -> None:
    agent = await connect_as(Role.AGENT, NODE)
    await agent.nc.publish(subject, b"forged")
    assert await agent.refusal() == publish_refused(subject)


async def test_agent_reads_releases_volumes_and_image_tags(secure: SecureCluster, control: Connection) -> None:
    for key in ("release.r1", "volume.v1", "image.i1"):
        await control.js.publish(f"{STATE_PREFIX}{key}", f"spec of {key}".encode())
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    try:
        for key in ("release.r1", "volume.v1", "image.i1"):
            got = await agent.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}{key}", direct=True)
            assert got.data == f"spec of {key}".encode()
    finally:
        await agent.close()


async def test_agent_cannot_read_other_keys(connect_as: ConnectAs, control: Connection) -> None:
    await control.js.publish(f"{STATE_PREFIX}env.e1", b"secret env")
    agent = await connect_as(Role.AGENT, NODE)
    js = agent.nc.jetstream(timeout=1)

    other = f"$JS.API.DIRECT.GET.{STATE_STREAM}.{STATE_PREFIX}env.e1"
    with pytest.raises(nats.errors.TimeoutError):
        await js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}env.e1", direct=True)
    assert await agent.refusal() == publish_refused(other)

    # The forms that do not carry the subject in the API subject would read any key: refused.
    for api in (f"$JS.API.STREAM.MSG.GET.{STATE_STREAM}", f"$JS.API.DIRECT.GET.{STATE_STREAM}"):
        await agent.nc.publish(api, b"{}", reply=agent.nc.new_inbox())
        assert await agent.refusal() == publish_refused(api)


@pytest.mark.parametrize("role", [Role.AGENT, Role.BUILDER, Role.PROXY, Role.MEMBER])
@pytest.mark.parametrize(
    "api",
    [
        f"$JS.API.CONSUMER.CREATE.{STATE_STREAM}",
        f"$JS.API.CONSUMER.CREATE.{STATE_STREAM}.mine.{STATE_PREFIX}assignment.{NODE}.*",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{STATE_STREAM}.view-{NODE}",
        "$JS.API.CONSUMER.CREATE.OBJ_zattera-images",
        "$JS.API.CONSUMER.CREATE.OBJ_zattera-snapshots.x.$O.zattera-snapshots.M.>",
        f"$JS.API.CONSUMER.DELETE.{STATE_STREAM}.view-{NODE}",
    ],
)
async def test_no_consumer_is_created_or_deleted_by_agents_or_proxies(
    connect_as: ConnectAs, role: Role, api: str
) -> None:
    """A consumer's deliver subject could name any subject of ZATTERA: only control creates consumers."""
    client = await connect_as(role, NODE)
    await client.nc.publish(api, b"{}", reply=client.nc.new_inbox())
    assert await client.refusal() == publish_refused(api)


async def test_agent_answers_only_its_own_node_requests(connect_as: ConnectAs) -> None:
    agent = await connect_as(Role.AGENT, NODE)
    await agent.nc.subscribe(agent_subject(NODE, "build"))
    await agent.nc.subscribe(agent_subject("n2", "build"))
    assert await agent.refusal() == f'nats: permissions violation for subscription to "{agent_subject("n2", "build")}"'


@pytest.mark.parametrize(
    "subject",
    [f"{STATE_PREFIX}env.e1", f"{STATE_PREFIX}observed.n1.a1", f"{LIVE_PREFIX}proxy.p2", ROUTES_SNAPSHOT_SUBJECT],
)
async def test_proxy_cannot_write_state(connect_as: ConnectAs, subject: str) -> None:
    proxy = await connect_as(Role.PROXY, "p1")
    await proxy.nc.publish(subject, b"forged")
    assert await proxy.refusal() == publish_refused(subject)


async def test_proxy_reports_its_traffic_and_follows_route_snapshots(secure: SecureCluster) -> None:
    proxy = await connect(secure.url, name="proxy", creds=secure.creds(Role.PROXY, "p1"))
    try:
        await proxy.js.publish(f"{LIVE_PREFIX}proxy.p1", b"sample")
        await proxy.nc.subscribe(ROUTES_SNAPSHOT_SUBJECT)
        await proxy.nc.flush()
    finally:
        await proxy.close()


async def test_operator_writes_desired_state_but_not_leases(connect_as: ConnectAs, join_service: JoinService) -> None:
    operator = await connect_as(Role.OPERATOR, "cli")
    ack = await operator.nc.jetstream().publish(f"{STATE_PREFIX}env.e2", b"desired")
    assert ack.stream == STATE_STREAM
    await operator.nc.publish(f"{STATE_PREFIX}lease.scheduler", b"usurper")
    assert await operator.refusal() == publish_refused(f"{STATE_PREFIX}lease.scheduler")


@pytest.mark.parametrize("role", [Role.OPERATOR, Role.AGENT, Role.BUILDER, Role.PROXY])
async def test_only_control_answers_or_asks_a_leaders_probe(connect_as: ConnectAs, role: Role) -> None:
    """An answer on a holder's probe subject would keep a dead leader's lease to its TTL, a probe costs the
    leader work: both are control's alone."""
    client = await connect_as(role, "p1" if role is Role.PROXY else NODE)
    probe = f"{LEASE_PROBE_PREFIX}01HOLDER"
    await client.nc.subscribe(probe)
    assert await client.refusal() == f'nats: permissions violation for subscription to "{probe.lower()}"'
    await client.nc.publish(probe, b"", reply=client.nc.new_inbox())
    assert await client.refusal() == publish_refused(probe)


async def test_an_agent_cannot_write_another_nodes_key_through_a_reply_subject(
    connect_as: ConnectAs, control: Connection, join_service: JoinService
) -> None:
    agent = await connect_as(Role.AGENT, NODE)
    own = f"{STATE_PREFIX}observed.{NODE}.redirect"
    victim = f"{STATE_PREFIX}assignment.n2.redirect"
    await agent.nc.jetstream().publish(own, b"forged")
    await agent.nc.publish(f"$JS.API.DIRECT.GET.{STATE_STREAM}.{own}", b"", reply=victim)
    await agent.nc.flush()
    for _ in range(50):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            stored = await control.js.get_last_msg(STATE_STREAM, victim)
            pytest.fail(f"the agent wrote {victim!r}: {stored.data!r}")
        await asyncio.sleep(0.02)


async def test_an_agent_asks_for_secrets_only_on_its_own_node_subject(
    connect_as: ConnectAs, control: Connection
) -> None:
    """The secrets service trusts the node named by the subject: only that node's credential may publish there."""

    async def answer(msg: Any) -> None:
        await msg.respond(b"sealed to n1")

    await control.nc.subscribe(open_subject("*"), cb=answer)
    await control.nc.flush()
    agent = await connect_as(Role.AGENT, NODE)
    reply = await answered_request(agent, open_subject(NODE), b"")
    assert reply.data == b"sealed to n1"
    await agent.nc.publish(open_subject("n2"), b"")
    assert await agent.refusal() == publish_refused(open_subject("n2"))
    await agent.nc.publish(ROTATE_SUBJECT, b"")
    assert await agent.refusal() == publish_refused(ROTATE_SUBJECT)


@pytest.mark.parametrize(
    "api",
    [
        # A log drain's durable consumer on a log stream (the member's own environment's or any): a member pulls
        # no consumer at all — what it follows is pushed by the authorising path (docs/teams.md).
        "$JS.API.CONSUMER.MSG.NEXT.ZATTERA_LOGS_e1.drain_datadog",
        "$JS.API.CONSUMER.INFO.ZATTERA_LOGS_e1.drain_datadog",
        "$JS.API.CONSUMER.MSG.NEXT.ZATTERA_LOGS_e1.watch-0123456789abcdef0123",
        f"$JS.API.CONSUMER.MSG.NEXT.{STATE_STREAM}.view-{NODE}",
    ],
)
async def test_a_member_pulls_no_consumer(connect_as: ConnectAs, api: str) -> None:
    member = await connect_as(Role.MEMBER, "vera")
    await member.nc.publish(api, b"{}", reply=member.nc.new_inbox())
    assert await member.refusal() == publish_refused(api)
