"""Steered replies (SECURITY.md, "Model: one account per role"), per role's credential on a real server.

Every reply a role can make the server send — a direct get, each ``$JS.API`` request it may make, a publish
ack (relayed or direct), a pull, a control service's answer — is aimed at other nodes' keys, assignments,
leases, env/release keys, live keys, the route-snapshot subject and another agent's request subject. The
answers go back into the role's account through the import's ``_R_`` mapping: every victim key keeps its
value and revision, nothing reaches ``ZATTERA``'s route-snapshot subscribers, and the other agent receives
nothing it would take for a request (no reply subject it could answer).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.msg import Msg

from shared.connection import Connection, connect
from shared.security.join import JoinService
from shared.security.permissions import VIEW_OPEN_SUBJECT, Role
from shared.subjects import (
    LIVE_PREFIX,
    LIVE_STREAM,
    ROUTES_SNAPSHOT_SUBJECT,
    STATE_PREFIX,
    STATE_STREAM,
    agent_subject,
    is_direct_request,
)
from tests.security.conftest import Client, ConnectAs, SecureCluster, answered_request

CLUSTER_TOO = True  # also against a secured three-server cluster (conftest.py)

NODE, OTHER = "steer-n1", "steer-n2"
VICTIM_KEYS = {
    STATE_STREAM: [
        f"{STATE_PREFIX}observed.{OTHER}.a1",
        f"{STATE_PREFIX}node.{OTHER}",
        f"{STATE_PREFIX}assignment.{OTHER}.a1",
        f"{STATE_PREFIX}assignment.{NODE}.a1",  # its own desired state, which it may only read
        f"{STATE_PREFIX}lease.scheduler",
        f"{STATE_PREFIX}env.steered",
        f"{STATE_PREFIX}release.steered",
    ],
    LIVE_STREAM: [f"{LIVE_PREFIX}node.{OTHER}", f"{LIVE_PREFIX}proxy.p2"],
}
VICTIM_SUBJECTS = [
    *(key for keys in VICTIM_KEYS.values() for key in keys),
    ROUTES_SNAPSHOT_SUBJECT,
    agent_subject(OTHER, "snapshot"),
    agent_subject(OTHER, "build"),
]
Trigger = Callable[[Client, str], Awaitable[None]]


def api(subject: str, body: bytes = b"") -> Trigger:
    async def send(client: Client, victim: str) -> None:
        await client.nc.publish(subject, body, reply=victim)

    return send


def publish(subject: str, data: bytes = b"steered") -> Trigger:
    """A write of the role's own key whose acknowledgement is aimed at the victim."""
    return api(subject, data)


TRIGGERS: dict[Role, list[Trigger]] = {
    Role.AGENT: [
        api(f"$JS.API.DIRECT.GET.{STATE_STREAM}.{STATE_PREFIX}assignment.{NODE}.a1"),
        api("$JS.API.INFO"),
        api("$JS.API.STREAM.NAMES"),
        api(f"$JS.API.STREAM.INFO.{STATE_STREAM}"),
        api("$JS.API.DIRECT.GET.OBJ_zattera-images", json.dumps({"seq": 1}).encode()),
        api(
            f"$JS.API.CONSUMER.MSG.NEXT.{STATE_STREAM}.view-{NODE}", json.dumps({"batch": 5, "no_wait": True}).encode()
        ),
        api(VIEW_OPEN_SUBJECT),  # a control service's answer (the join service)
        publish(f"{STATE_PREFIX}observed.{NODE}.a1"),  # relayed ack
        publish(f"{LIVE_PREFIX}node.{NODE}"),  # direct ack
    ],
    Role.PROXY: [api("$JS.API.INFO"), publish(f"{LIVE_PREFIX}proxy.p1")],
    Role.OPERATOR: [
        api("$JS.API.INFO"),
        api("$JS.API.STREAM.NAMES"),
        api(f"$JS.API.DIRECT.GET.{STATE_STREAM}.{STATE_PREFIX}env.steered"),
        api(f"$JS.API.STREAM.MSG.GET.{STATE_STREAM}", json.dumps({"last_by_subj": f"{STATE_PREFIX}env.x"}).encode()),
        publish(f"{STATE_PREFIX}env.operator-own"),
    ],
}


async def revisions(control: Connection) -> dict[str, tuple[int, bytes]]:
    found = {}
    for stream, keys in VICTIM_KEYS.items():
        for key in keys:
            msg = await control.js.get_last_msg(stream, key, direct=True)
            found[key] = (msg.seq or 0, msg.data or b"")
    return found


@pytest.mark.parametrize("role", [Role.AGENT, Role.PROXY, Role.OPERATOR])
async def test_no_reply_a_role_triggers_lands_anywhere_but_its_own_account(
    secure: SecureCluster, control: Connection, connect_as: ConnectAs, join_service: JoinService, role: Role
) -> None:
    for stream, keys in VICTIM_KEYS.items():
        for key in keys:
            await control.js.publish(key, b"intact", stream=stream)
    await control.js.publish(f"{STATE_PREFIX}assignment.{NODE}.a1", b"desired", stream=STATE_STREAM)
    before = await revisions(control)

    on_control: list[Msg] = []
    await control.nc.subscribe(ROUTES_SNAPSHOT_SUBJECT, cb=recorder(on_control))
    victim = await connect(secure.url, name="victim", creds=secure.creds(Role.AGENT, OTHER))
    at_victim: list[Msg] = []
    await victim.nc.subscribe(agent_subject(OTHER, ">"), cb=recorder(at_victim))
    await victim.nc.flush()
    try:
        client = await connect_as(role, NODE if role is not Role.PROXY else "p1")
        if role is Role.AGENT:
            await answered_request(client, VIEW_OPEN_SUBJECT, b"")  # its consumer exists: pulls answer
        for trigger in TRIGGERS[role]:
            for subject in VICTIM_SUBJECTS:
                await trigger(client, subject)
        await client.nc.flush()
        await asyncio.sleep(0.5)  # the answers are on their way back: give them the time to land anywhere
        assert client.errors == []  # every trigger is something the role may do
        assert await revisions(control) == before
        assert on_control == []
        assert not [m for m in at_victim if is_direct_request(m)], [m.subject for m in at_victim]
    finally:
        await victim.close()


def recorder(into: list[Msg]) -> Callable[[Msg], Awaitable[None]]:
    async def record(msg: Msg) -> None:
        into.append(msg)

    return record
