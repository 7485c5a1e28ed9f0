"""``zattera up --nats-cluster 3``: three local servers as one JetStream cluster, everything at replicas=3,
children told every URL and the replica count."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from cli.up import Cluster, _provision
from shared.natsio import EVENTS_STREAM, LIVE_STREAM, STATE_STREAM, connect


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


def test_nats_cluster_with_secure_is_refused_naming_the_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--secure", "--nats-cluster", "3"])
    assert result.exit_code != 0
    assert "--nats-cluster" in result.output
