"""Operators create no consumers: the CLI's watches are pull consumers control opens (``zattera.watch.open``,
shared/watches.py) and the operator only pulls them, on a real secured server."""

from __future__ import annotations

import json

import pytest

from shared.connection import Connection, connect
from shared.security.permissions import Role
from shared.subjects import EVENTS_STREAM
from shared.watches import WATCH_OPEN_SUBJECT, BadWatch, WatchSpec, follow, open_watch
from tests.security.conftest import ConnectAs, SecureCluster
from tests.security.test_permissions import publish_refused


async def test_an_operator_may_not_create_a_consumer(connect_as: ConnectAs) -> None:
    operator = await connect_as(Role.OPERATOR, "ops")
    for subject in (
        f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}",
        f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.c1.zattera.events.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS_STREAM}.c1",
        "$JS.API.CONSUMER.CREATE.KV_zattera-state.c1.$KV.zattera-state.lease.scheduler",
    ):
        config = {"stream_name": EVENTS_STREAM, "config": {"deliver_subject": "$KV.zattera-state.lease.scheduler"}}
        await operator.nc.publish(subject, json.dumps(config).encode(), reply=operator.nc.new_inbox())
        assert await operator.refusal() == publish_refused(subject)


async def test_an_operator_follows_a_watch_control_opens(
    secure: SecureCluster, control: Connection, watches: None
) -> None:
    operator = await connect(secure.url, name="operator", creds=secure.creds(Role.OPERATOR, "ops"))
    try:
        for n in range(3):
            await control.js.publish(f"zattera.events.test.{n}", f"stored {n}".encode())
        watch = await follow(operator, WatchSpec(EVENTS_STREAM, ("zattera.events.test.>",), "all"))
        try:
            stored = [await watch.next_stored(5.0) for _ in range(3)]
            assert [m.data for m in stored if m is not None] == [b"stored 0", b"stored 1", b"stored 2"]
            assert await watch.next_stored(5.0) is None  # caught up
            await control.js.publish("zattera.events.test.9", b"new")
            assert (await watch.next_msg(5.0)).data == b"new"
        finally:
            await watch.unsubscribe()
        with pytest.raises(BadWatch, match="stream"):
            await open_watch(operator, WatchSpec("no.such", ("x",)))
    finally:
        await operator.close()


async def test_watch_open_answers_only_a_requesters_reply_subject(control: Connection, watches: None) -> None:
    steered = await control.nc.subscribe("zattera.events.steered")
    spec = WatchSpec(EVENTS_STREAM, ("zattera.events.>",))
    await control.nc.publish(WATCH_OPEN_SUBJECT, spec.to_json(), reply="zattera.events.steered")
    await control.nc.flush()
    with pytest.raises(TimeoutError):
        await steered.next_msg(timeout=0.5)
