"""Tables for people: in a pipe (CliRunner output is not a terminal) nothing is cut at 80 columns and no
id is wrapped; ``--wide`` adds the id columns; environments are shown by name, not id. Against a real
NATS server, with the real routes service for ``zattera routes``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.events import EventPublisher, make_event
from tests.cli.rig import state
from tests.factories import assignment, node, release
from tests.waiting import eventually_sync

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LONG_NODE = "node-with-a-rather-long-name-in-a-big-datacenter-eu-west-1"
SPEC = """
project = "demo"
app = "hello"

[env.production]
replicas = 1
domains = ["hello.example.com"]
"""


def _seed_a_healthy_replica(cli, nats_url: str, tmp_path: Path) -> tuple[str, str]:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    env_id = json.loads(cli("apps", "apply", str(spec), "--json").stdout)["env_ids"]["production"]

    async def seed(conn, view, writer) -> str:
        n = node(LONG_NODE)
        n.mesh_ip = "127.0.0.1"
        rel = release("R" * 26, env_id)
        env = pb.Environment()
        env.CopyFrom(view.env(env_id))
        env.active_release_id = rel.meta.id
        a = assignment(LONG_NODE, env_id, rel.meta.id)
        a.mesh_port_bindings["http"] = 31001
        await writer.commit(writer.txn().create(n).create(rel).put(env).create(a))
        observed = pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY)
        observed.mesh_port_bindings["http"] = 31001
        await writer.commit(writer.txn().put(observed, key=K.observed(LONG_NODE, a.meta.id)))
        return a.meta.id

    return env_id, state(nats_url, seed)


def test_ps_in_a_pipe_keeps_every_row_whole_and_wide_adds_ids(cli, nats_url, tmp_path: Path) -> None:
    env_id, assignment_id = _seed_a_healthy_replica(cli, nats_url, tmp_path)
    out = cli("ps").stdout
    row = next(line for line in out.splitlines() if LONG_NODE in line)
    assert "demo/hello/production" in row and "healthy" in row and "http:31001" in row
    assert len(row) > 80  # not cut to 80 columns
    assert assignment_id not in out and env_id not in out  # names, not ids, by default
    wide = cli("ps", "--wide").stdout
    assert any(assignment_id in line and LONG_NODE in line for line in wide.splitlines())

    listed = cli("apps", "list").stdout
    assert "demo/hello/production" in listed and env_id not in listed
    assert any(
        env_id in line and "demo/hello/production" in line for line in cli("apps", "list", "--wide").stdout.splitlines()
    )


def test_routes_shows_project_app_and_env_names(cli, nats_url, tmp_path: Path) -> None:
    env_id, assignment_id = _seed_a_healthy_replica(cli, nats_url, tmp_path)
    routes = subprocess.Popen(
        [sys.executable, "-m", "services.routes", "--nats", nats_url],
        cwd=PROJECT_ROOT,
        env={"PATH": "/usr/bin:/bin", "ZATTERA_DOMAIN": ""},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def routed() -> bool:
            result = cli("routes", "--json")
            return result.exit_code == 0 and any(
                r["endpoints"] for r in json.loads(result.stdout).get("http_routes", [])
            )

        eventually_sync(routed, 30, "a route with an endpoint")
        out = cli("routes").stdout
        row = next(line for line in out.splitlines() if "hello.example.com" in line)
        assert "demo/hello/production" in row and "127.0.0.1:31001" in row
        assert env_id not in out and assignment_id not in out
        wide = cli("routes", "--wide").stdout
        row = next(line for line in wide.splitlines() if "hello.example.com" in line)
        assert env_id in row and f"{LONG_NODE}/{assignment_id}" in row
    finally:
        routes.terminate()
        routes.wait(10)


def test_a_long_event_line_is_not_cut_in_a_pipe(cli, nats_url) -> None:
    message = "deployment 01JABCDEFGHJKMNPQRSTVWXYZ0 of demo/hello/production failed: " + "x" * 80

    async def publish(conn, view, writer):
        await EventPublisher(conn).publish(make_event("deploy.failed", message))

    state(nats_url, publish)
    out = cli("events", "--last", "5").stdout
    assert any(line.endswith(message) for line in out.splitlines()), out
