"""Version skew enforced by the components themselves, on a real nats-server: an agent waits for a cluster
the control plane has not upgraded yet and goes on once it is; a real agent process too old for the
cluster exits saying so in one line and writes nothing; a proxy reports its version in its heartbeat and
says once per control-plane version when that one is outside its window; leases carry their holder's
version."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection, connect
from shared.live import proxy_key
from shared.migrations.registry import SCHEMA
from shared.migrations.runner import record, upgrade
from shared.process import Process
from shared.provisioning import recorded_config
from shared.routewire import content_digest, encode_messages
from shared.settings import settings
from shared.skew import Component, SkewRefused
from shared.subjects import LIVE_BUCKET, ROUTES_SNAPSHOT_SUBJECT, STATE_PREFIX, STATE_STREAM
from shared.version import VERSION
from tests.compat.releases import PREVIOUS, recreate
from tests.proxy.harness import Routes, start_proxy
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


def process() -> Process:
    import argparse

    return Process("agent", argparse.Namespace(nats=None), settings(), asyncio.Event(), metrics=False)


async def test_an_agent_ahead_of_the_cluster_waits_for_its_upgrade_then_goes_on(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    conn = await connect(nats_url, name="t")
    try:
        await recreate(conn, PREVIOUS)  # a 0.1.0 cluster: schema 0
        caplog.set_level(logging.WARNING, logger="shared.process")
        agent = process()
        waiting = asyncio.create_task(agent.await_compatible(conn, Component.AGENT, poll=0.1))
        await eventually(lambda: "has not been upgraded yet" in caplog.text, 5, "the agent says why it waits")
        await asyncio.sleep(0.3)
        assert not waiting.done()  # it waits: it needs schema 1
        await upgrade(conn, holder="control-plane")
        assert await asyncio.wait_for(waiting, 5) is True
        assert caplog.text.count("has not been upgraded yet") == 1  # said once, not per poll

        stopped = process()
        stopped.stop.set()
        assert await stopped.await_compatible(conn, Component.AGENT) is False
    finally:
        await conn.close()


async def test_an_agent_too_old_for_the_cluster_exits_saying_so_and_registers_nothing(
    conn: Connection, tmp_path: Path
) -> None:
    now = await recorded_config(conn.js)
    assert now is not None
    await record(conn, dataclasses.replace(now, schema=SCHEMA + 4, version="0.5.0"))
    with pytest.raises(SkewRefused):
        await process().await_compatible(conn, Component.AGENT)
    url = conn.nc.connected_url
    assert url is not None
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.agent", "--nats", f"nats://{url.netloc}", "--node-id", "old-n1"],
        cwd=ROOT,
        env={**os.environ, "ZATTERA_AGENT_RUNTIME": "process", "ZATTERA_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: this agent (Zattera {VERSION}) is too old for the cluster (Zattera 0.5.0, schema {SCHEMA + 4}), "
        "which accepts 0.4 or newer: upgrade it (docs/upgrades.md)"
    ]
    with pytest.raises(NotFoundError):
        await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.node("old-n1"))


async def test_a_proxy_reports_its_version_and_says_once_when_its_control_plane_is_too_far(
    conn: Connection, nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="services.proxy.server")
    proxy = await start_proxy(nats_url, tmp_path)
    try:
        live = await conn.js.key_value(LIVE_BUCKET)

        async def reports_its_version() -> bool:
            try:
                entry = await live.get(proxy_key("p1"))
            except Exception:
                return False
            return cpb.ProxyHeartbeat.FromString(entry.value or b"").version == VERSION

        await eventually(reports_its_version, 5, "the heartbeat carries the version")
        routes = Routes(conn)
        for control in ("0.9.0", "0.9.0", VERSION, "0.9.0"):
            snapshot = routes.snapshot()
            snapshot.control_version = control
            await _publish(conn, snapshot)
            await eventually(lambda v=snapshot.version: proxy.table.version == v, 5, "snapshot applied")
        assert (
            caplog.text.count("is too old for its control plane (Zattera 0.9.0)") == 2
        )  # per change, not per snapshot
        assert proxy.table.version == routes.version  # served regardless
    finally:
        await proxy.stop()


async def _publish(conn: Connection, snapshot: cpb.RouteSnapshot) -> None:
    data = snapshot.SerializeToString(deterministic=True)
    for message in encode_messages(
        data, version=snapshot.version, digest=content_digest(data), max_message_bytes=1 << 20
    ):
        await conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)
    await conn.nc.flush()


async def test_a_lease_names_its_holders_version(conn: Connection) -> None:
    from shared.lease import Lease

    lease = Lease(conn, "versioned", "holder-1")
    assert await lease.try_acquire()
    try:
        msg = await conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.lease("versioned"), direct=True)
        assert pb.Lease.FromString(msg.data).version == VERSION
    finally:
        await lease.release()
