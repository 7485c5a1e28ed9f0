"""``zattera up --nats-cluster 3``: three local servers as one JetStream cluster, everything at replicas=3,
children told every URL and the replica count; a server that dies is restarted and rejoins."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cli.up_cluster import Cluster
from cli.up_provision import _provision
from shared.connection import connect
from shared.subjects import EVENTS_STREAM, LIVE_STREAM, STATE_STREAM
from tests.waiting import eventually


async def test_nats_cluster_option_provisions_everything_at_three_replicas(tmp_path: Path) -> None:
    cluster = Cluster(data_dir=tmp_path, nats_cluster=3, services=[], with_node=False)
    try:
        cluster.start_nats()
        assert len(cluster.url.split(",")) == 3
        await _provision(cluster.url, replicas=cluster.replicas)
        env = cluster.child_env()
        assert env["ZATTERA_REPLICAS"] == "3"
        assert env["ZATTERA_NATS_URL"] == cluster.url
        conn = await connect(cluster.url, name="up-cluster-test")
        try:
            for stream in (STATE_STREAM, LIVE_STREAM, EVENTS_STREAM):
                info = await conn.js.stream_info(stream)
                assert info.config.num_replicas == 3, stream
                assert info.cluster is not None and info.cluster.leader
        finally:
            await conn.close()
    finally:
        cluster.stop()
    assert all(s.pid is None for s in cluster.cluster_servers)


async def test_a_nats_server_that_dies_is_restarted_and_rejoins(tmp_path: Path) -> None:
    cluster = Cluster(data_dir=tmp_path, nats_cluster=3, services=[], with_node=False)
    try:
        cluster.start_nats()
        await _provision(cluster.url, replicas=cluster.replicas)
        victim = cluster.cluster_servers[1]
        port, pid = victim.port, victim.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: victim.exited() is not None, 10, "the server's death noticed")
        cluster.supervise_once()
        assert victim.pid not in (None, pid) and victim.port == port and victim.exited() is None
        conn = await connect(victim.url, name="rejoin-check")
        try:

            async def state_replicas_current() -> bool:
                try:
                    info = await conn.js.stream_info(STATE_STREAM)
                except Exception:  # the rejoining server may not answer for JetStream yet: ask again
                    return False
                peers = info.cluster.replicas if info.cluster else None
                return bool(peers) and all(p.current for p in peers or [])

            await eventually(state_replicas_current, 30, "the restarted server caught up")
        finally:
            await conn.close()
    finally:
        cluster.stop()
