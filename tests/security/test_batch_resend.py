"""An atomic batch nobody takes — no relay subscribed yet (one restarting, or just started), or a relay that
found no stream leader (503) — stored nothing, so the writer sends it again until one does, within its commit
timeout: the CLI's writer on a secured server, the join service (the relay) started only after the first
send was refused."""

from __future__ import annotations

import asyncio

from zattera.v1 import types_pb2 as pb

from cli.writer import CheckedWriter
from shared.audit import Auditor
from shared.connection import Connection
from shared.security.authority import RoleIssuer
from shared.security.join import JoinService
from shared.security.permissions import Role
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.watches import STATE_WATCH, open_watch
from tests.security.conftest import ManualClock, SecureCluster
from tests.waiting import eventually


async def test_a_batch_sent_before_any_relay_is_there_lands_once_one_is(
    secure: SecureCluster, operator: Connection, control: Connection, clock: ManualClock, watches: None
) -> None:
    async def open_state_watch() -> str:
        return await open_watch(operator, STATE_WATCH)

    view = StateView(operator, name="cli", open_consumer=open_state_watch)
    await view.load_snapshot(10)
    writer = CheckedWriter(operator, view, Auditor(source="cli", user="", verified=False), secured=True)
    txn = writer.txn()
    for name in ("early", "bird"):
        project = pb.Project(name=name)
        project.meta.id = f"01RESEND{name.upper()}"
        txn.create(project)
    commit = asyncio.create_task(writer.commit(txn))
    await eventually(lambda: writer.resent >= 1 or commit.done(), what="the batch refused for want of a relay")
    assert not commit.done()  # nobody took it: still being sent, not failed
    issuers = {role: RoleIssuer.load(secure.setup.directory, role) for role in (Role.AGENT, Role.BUILDER)}
    service = JoinService(control, issuers, secure.setup.sentinel_jwt(), now=clock)
    relay = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(commit, 20)
        for name in ("EARLY", "BIRD"):
            key = f"{STATE_PREFIX}project.01RESEND{name}"
            info = await control.js.stream_info(STATE_STREAM, subjects_filter=key)
            assert info.state.subjects == {key: 1}  # stored once
    finally:
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
