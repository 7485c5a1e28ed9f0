"""``zattera events`` over a real NATS: readable lines (scope, from → to, who decided), --kind prefixes,
--env, --json one object per line, bad input; and the operator's node edits announce themselves."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from shared.connection import Connection, connect
from shared.events import KINDS, EventPublisher, make_event
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests.cli.rig import Invoke, initialised_cli
from tests.factories import node
from tests.orchestrator.rig import environment, spec


@pytest.fixture
def cli(nats_url: str) -> Invoke:
    return initialised_cli(nats_url)


def in_state(nats_url: str, fn: Callable[[Connection, Writer], Awaitable[None]]) -> None:
    async def go() -> None:
        conn = await connect(nats_url, name="t")
        await provision(conn.js)
        view = StateView(conn, name="t")
        await view.start()
        try:
            await fn(conn, Writer(conn, view))
        finally:
            await view.stop()
            await conn.close()

    asyncio.run(go())


def seed(nats_url: str) -> None:
    async def go(conn: Connection, writer: Writer) -> None:
        project = pb.Project(name="demo")
        project.meta.id = "p1"
        application = pb.App(project_id="p1", name="hello")
        application.meta.id = "a1"
        await writer.commit(
            writer.txn()
            .put(project)
            .put(application)
            .put(environment("e1", spec(1)))
            .put(environment("e2", spec(1)))
            .put(node("n1"))
        )
        scaled = make_event(
            "autoscale.scaled",
            "autoscaled production from 2 to 4 replicas",
            environment_id="e1",
            fields={"actor": "system:autoscaler", "from": "2", "to": "4"},
        )
        failed = make_event("deploy.failed", "a green instance failed to start", severity="error", environment_id="e2")
        down = make_event(
            "node.down", "node n1 missed heartbeats", node_id="n1", fields={"from": "ALIVE", "to": "DOWN"}
        )
        await EventPublisher(conn).publish(scaled, failed, down)

    in_state(nats_url, go)


def test_events_are_readable_lines_with_scope_change_and_actor(cli: Invoke, nats_url: str) -> None:
    seed(nats_url)
    result = cli("events")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert "autoscale.scaled" in lines[0] and "demo/hello/e1" in lines[0]
    assert "2 → 4" in lines[0] and "actor=system:autoscaler" in lines[0]
    assert "deploy.failed" in lines[1] and "a green instance failed to start" in lines[1]
    assert "node n1" in lines[2] and "ALIVE → DOWN" in lines[2]


def test_events_filter_by_kind_prefix_and_env(cli: Invoke, nats_url: str) -> None:
    seed(nats_url)
    by_kind = cli("events", "--kind", "node", "--json")
    assert [json.loads(line)["kind"] for line in by_kind.stdout.splitlines()] == ["node.down"]
    by_env = cli("events", "--env", "demo/hello/e2", "--json")
    assert [json.loads(line)["kind"] for line in by_env.stdout.splitlines()] == ["deploy.failed"]
    last = cli("events", "--last", "1", "--json")
    assert [json.loads(line)["kind"] for line in last.stdout.splitlines()] == ["node.down"]


def test_events_bad_input_is_one_clear_line(cli: Invoke, nats_url: str) -> None:
    seed(nats_url)
    unknown = cli("events", "--env", "demo/hello/nope")
    assert unknown.exit_code == 1 and "--env: no environment 'demo/hello/nope'" in unknown.output
    negative = cli("events", "--last", "-1")
    assert negative.exit_code == 2 and "--last must be 0 or more" in negative.output


def test_operator_node_edits_are_announced(cli: Invoke, nats_url: str) -> None:
    seed(nats_url)
    for verb in ("cordon", "uncordon", "drain"):
        assert cli("nodes", verb, "n1").exit_code == 0
    assert cli("nodes", "label", "n1", "zone=a").exit_code == 0  # not a status change: no event
    out = cli("events", "--kind", "node", "--json").stdout.splitlines()
    changes = [json.loads(line) for line in out][1:]
    assert [(e["kind"], e["fields"]["actor"], e["fields"]["from"], e["fields"]["to"]) for e in changes] == [
        ("node.cordoned", "operator", "ALIVE", "ALIVE"),
        ("node.uncordoned", "operator", "ALIVE", "ALIVE"),
        ("node.draining", "operator", "ALIVE", "DRAINING"),
    ]


APP_SPEC = """
project = "shop"
app = "web"

[run]
command = "python app.py"

[env.production]
replicas = {{ min = {replicas}, max = 8 }}
"""


def test_an_operator_replica_change_is_announced(cli: Invoke, nats_url: str, tmp_path: Path) -> None:
    toml = tmp_path / "zattera.toml"
    toml.write_text(APP_SPEC.format(replicas=2))
    env_id = json.loads(cli("apps", "apply", str(toml), "--json").stdout)["env_ids"]["production"]

    async def go_live(conn: Connection, writer: Writer) -> None:
        env = writer.view.env(env_id)
        assert env is not None
        live = pb.Environment()
        live.CopyFrom(env)
        live.active_release_id = "r1"
        await writer.commit(writer.txn().put(live))

    in_state(nats_url, go_live)
    toml.write_text(APP_SPEC.format(replicas=3))
    assert cli("apps", "apply", str(toml)).exit_code == 0
    [scaled] = [json.loads(line) for line in cli("events", "--json").stdout.splitlines()]
    assert scaled["kind"] == "scale.changed" and scaled["environment_id"] == env_id
    assert (scaled["fields"]["actor"], scaled["fields"]["from"], scaled["fields"]["to"]) == ("operator", "2", "3")


def test_follow_streams_new_events_as_they_come(nats_url: str) -> None:
    seed(nats_url)
    argv = [sys.executable, "-c", "from cli.main import main; main()", "--nats", nats_url]
    follower = subprocess.Popen(
        [*argv, "events", "--follow", "--last", "1", "--kind", "deploy", "--json"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert follower.stdout is not None
        assert json.loads(follower.stdout.readline())["kind"] == "deploy.failed"  # the backlog: the last one

        async def publish(conn: Connection, writer: Writer) -> None:
            await EventPublisher(conn).publish(make_event("node.up", "not a deploy", node_id="n1"))
            await EventPublisher(conn).publish(make_event("deploy.succeeded", "later", environment_id="e1"))

        in_state(nats_url, publish)
        assert json.loads(follower.stdout.readline())["kind"] == "deploy.succeeded"
    finally:
        follower.terminate()
        follower.wait(10)


def test_an_unknown_kind_is_refused_listing_the_known_ones_and_a_stored_one_is_known(
    cli: Invoke, nats_url: str
) -> None:
    seed(nats_url)
    for typo in ("nosuch", "deploy.faild", "*.faild"):
        refused = cli("events", "--kind", typo)
        assert refused.exit_code == 1, (typo, refused.output)
        assert f"--kind {typo!r}: no such event kind" in refused.output
        assert "deploy.failed" in refused.output and "Families: " in refused.output and "node" in refused.output
    for known in ("deploy", "deploy.failed", "*.failed", "node.>"):
        assert cli("events", "--kind", known).exit_code == 0, known

    async def publish(conn: Connection, writer: Writer) -> None:  # a kind of a newer version, already stored
        await EventPublisher(conn).publish(make_event("gadget.launched", "not in this version's catalogue"))

    in_state(nats_url, publish)
    stored = cli("events", "--kind", "gadget", "--json")
    assert stored.exit_code == 0 and json.loads(stored.stdout)["kind"] == "gadget.launched"


def test_every_event_kind_is_in_the_documented_catalogue() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = "\n".join(page.read_text() for page in docs.glob("*.md"))
    assert [kind for kind in KINDS if f"`{kind}`" not in text and f"{kind}`" not in text] == []
    table = (docs / "observability.md").read_text().split("### Catalogue", 1)[1].split("## Metrics", 1)[0]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {kind for cell in first_cells for kind in re.findall(r"`([a-z_.]+)`", cell)}
    assert sorted(documented - set(KINDS)) == []


def test_events_of_a_deleted_env_name_it(cli: Invoke, tmp_path: Path) -> None:
    toml = tmp_path / "zattera.toml"
    toml.write_text(APP_SPEC.format(replicas=2))
    env_id = json.loads(cli("apps", "apply", str(toml), "--json").stdout)["env_ids"]["production"]
    assert cli("scale", "--env", "shop/web/production", "3").exit_code == 0
    assert cli("envs", "delete", "shop/web/production", "--yes").exit_code == 0
    lines = cli("events").stdout.splitlines()
    assert [line for line in lines if "env.scaled" in line or "env.deleted" in line]
    assert all("shop/web/production (deleted)" in line for line in lines if "env." in line), lines
    assert not [line for line in lines if env_id in line]
