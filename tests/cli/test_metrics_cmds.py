"""``zattera metrics`` on a real cluster: points stored by the history loop's format read back as a table
with sparklines, as JSON, for an env (by path) and a node; bad options name the option."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from zattera.cluster.v1 import cluster_pb2 as cpb

from shared import history as H
from shared.state.feed import StateView
from shared.txn import Writer
from tests.cli.rig import Invoke, state
from tests.cli.test_config_secrets import ENV, applied, the_env
from tests.factories import node

__all__ = ["applied"]


def seed_points(nats_url: str) -> str:
    async def go(conn: Any, view: StateView, writer: Writer) -> str:
        await writer.commit(writer.txn().put(node("n1")))
        env_id = the_env(view).meta.id
        await H.ensure_streams(conn.js, 1)
        now = int(time.time() // 10 * 10)
        for i in range(30):
            t = now - 310 + 10 * i  # up to a slot that surely ended
            point = cpb.MetricPoint(time=t, span=10, rps=float(i), responses_2xx=10 * i, responses_5xx=i % 3, running=1)
            await conn.js.publish(H.subject(H.RAW, H.ENV, env_id), point.SerializeToString())
            node_point = cpb.MetricPoint(time=t, span=10, cpu_percent=50.0, memory_bytes=2 << 30, instances=2)
            await conn.js.publish(H.subject(H.RAW, H.NODE, "n1"), node_point.SerializeToString())
        await conn.js.publish(H.mark_subject(env_id), H.mark_of(now - 100, "deploy.succeeded", "release v2 is live"))
        return env_id

    return str(state(nats_url, go))


def test_metrics_of_an_env_and_a_node(cli: Invoke, applied: Path, nats_url: str) -> None:
    env_id = seed_points(nats_url)
    shown = cli("metrics", "--env", ENV, "--since", "10m")
    assert shown.exit_code == 0, shown.output
    assert f"env {ENV} · last 10m" in shown.output
    rps = next(line for line in shown.output.splitlines() if line.startswith("requests/s"))
    assert "29.0" in rps and "█" in rps
    assert "deploy.succeeded" in shown.output and "release v2 is live" in shown.output
    as_json = json.loads(cli("metrics", "--env", env_id, "--since", "10m", "--json").stdout)
    assert as_json["span"] == 10 and as_json["name"] == ENV
    assert max(v for v in as_json["series"]["rps"] if v is not None) == 29.0
    assert as_json["marks"][0]["kind"] == "deploy.succeeded"
    nodes = cli("metrics", "--node", "n1", "--since", "10m")
    assert nodes.exit_code == 0 and "instances" in nodes.output and "2048" in nodes.output


def test_bad_metrics_options_name_the_option(cli: Invoke) -> None:
    bad = cli("metrics", "--env", "x", "--since", "yesterday")
    assert bad.exit_code == 2 and "--since 'yesterday'" in bad.output
    both = cli("metrics", "--env", "x", "--node", "y")
    assert both.exit_code == 2 and "exactly one of --env, --node or --proxy" in both.output
    missing = cli("metrics", "--env", "no/such/env")
    assert missing.exit_code == 1 and "--env: no environment 'no/such/env'" in missing.output


def seed_replica_points(nats_url: str) -> str:
    async def go(conn: Any, view: StateView, writer: Writer) -> str:
        env_id = the_env(view).meta.id
        await H.ensure_streams(conn.js, 1)
        now = int(time.time() // 10 * 10)
        for i in range(30):
            point = cpb.MetricPoint(time=now - 310 + 10 * i, span=10, running=2)
            point.replicas.add(id="AAAAAAA1", cpu_percent=10.0 + i, memory_bytes=64 << 20, node="n1", version=3)
            if i < 10:
                point.replicas.add(id="BBBBBBB2", cpu_percent=5.0, memory_bytes=32 << 20, node="n2", version=2)
            await conn.js.publish(H.subject(H.RAW, H.ENV, env_id), point.SerializeToString())
        return env_id

    return str(state(nats_url, go))


def test_metrics_per_replica(cli: Invoke, applied: Path, nats_url: str) -> None:
    env_id = seed_replica_points(nats_url)
    shown = cli("metrics", "--env", ENV, "--since", "10m", "--replicas")
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert "CPU and memory per replica" in lines[0]
    running = next(line for line in lines if line.startswith("…AAAAAAA1 v3 on n1"))
    assert "cpu %" in running and "39.0" in running and "█" in running
    stopped = next(line for line in lines if line.startswith("…BBBBBBB2 v2 on n2 (stopped)"))
    assert "5.0" in stopped
    assert any(line.strip().startswith("memory MiB") and " 64 " in line for line in lines)
    as_json = json.loads(cli("metrics", "--env", env_id, "--since", "10m", "--replicas", "--json").stdout)
    assert as_json["name"] == ENV and as_json["span"] == 10 and as_json["replicas_left_out"] == 0
    assert [r["label"] for r in as_json["replicas"]] == ["…AAAAAAA1 v3 on n1", "…BBBBBBB2 v2 on n2"]
    assert max(v for v in as_json["replicas"][0]["cpu_percent"] if v is not None) == 39.0
    bad = cli("metrics", "--node", "n1", "--replicas")
    assert bad.exit_code == 2 and "--replicas: per-replica series are kept for an env only" in bad.output
