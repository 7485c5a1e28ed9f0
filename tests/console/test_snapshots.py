"""Snapshots from the console: take one on the volume's node (a real snapshot agent on real NATS), then
restore it; a refused restore names why."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.chunking import TEST_PARAMS
from services.agent.snapshots.handlers import SnapshotAgent
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Writer
from tests import factories
from tests.console.rig import ADMIN_USER, Running, add_users, running_console
from tests.console.test_auth import client, csrf_of, log_in
from tests.waiting import eventually


@pytest.fixture
async def agent(conn: Connection, tmp_path: Path) -> AsyncIterator[SnapshotAgent]:
    node_agent = SnapshotAgent(conn, "n1", tmp_path / "volumes", params=TEST_PARAMS, heartbeat=0.2)
    await node_agent.start()
    try:
        yield node_agent
    finally:
        await node_agent.stop()


@pytest.fixture
async def console(conn: Connection, view: StateView, writer: Writer) -> AsyncIterator[Running]:
    await add_users(conn)
    volume = pb.Volume(project_id="p1", environment_id="e1", name="data", node_id="n1")
    volume.status = pb.VOLUME_STATUS_ACTIVE
    volume.meta.id = "vol1"
    await writer.commit(writer.txn().put(factories.node("n1")).put(volume))
    async with running_console(conn, view, writer) as running:
        yield running


async def _post(
    http: aiohttp.ClientSession, url: str, csrf: str, form: dict[str, str]
) -> tuple[int, dict[str, object]]:
    headers = {"X-CSRF-Token": csrf, "Accept": "application/json"}
    async with http.post(url, data=form, headers=headers) as answer:
        return answer.status, await answer.json()


async def test_take_a_snapshot_then_restore_it(console: Running, view: StateView, agent: SnapshotAgent) -> None:
    data = agent.volumes_root / "vol1"
    data.mkdir(parents=True)
    (data / "orders.db").write_bytes(b"rows v1")
    async with client() as http:
        await log_in(http, console.url, ADMIN_USER)
        csrf = await csrf_of(http, console.url)
        status, taken = await _post(http, f"{console.url}/volumes/vol1/snapshot", csrf, {})
        assert status == 200, taken
        snapshot_id = str(taken["snapshot_id"])

        def complete() -> bool:
            record = view.snapshot(snapshot_id)
            return record is not None and record.status == pb.SNAPSHOT_STATUS_COMPLETE

        await eventually(complete, what="the snapshot COMPLETE")
        (data / "orders.db").write_bytes(b"rows v2, damaged")
        status, restored = await _post(http, f"{console.url}/volumes/vol1/restore", csrf, {"snapshot_id": snapshot_id})
        assert status == 200, restored

        def back() -> bool:
            volume = view.volume("vol1")
            return volume is not None and volume.status == pb.VOLUME_STATUS_ACTIVE

        await eventually(back, what="the volume ACTIVE again")
        assert (data / "orders.db").read_bytes() == b"rows v1"
        status, refused = await _post(http, f"{console.url}/volumes/vol1/restore", csrf, {"snapshot_id": "nope"})
        assert status == 409 and refused == {"error": "snapshot nope is not COMPLETE"}
