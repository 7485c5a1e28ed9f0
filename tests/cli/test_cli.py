"""The zattera command against a real NATS server (the CLI runs its own event loop, so tests are sync)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner
from zattera.v1 import types_pb2 as pb

from cli.main import app
from shared import keys as K
from shared.events import EventPublisher, make_event
from tests.cli.rig import state
from tests.factories import node

VALID = """
project = "demo"
app = "hello"

[run]
command = "python app.py"

[env.production]
replicas = { min = 2, max = 4 }
resources = { cpu_millis = 250, memory_mb = 128 }
healthcheck = { type = "http", path = "/healthz", interval = "2s", grace_period = "5s" }
domains = ["hello.example.com"]

[env.staging]
scale_to_zero = true
idle_timeout = "10m"
"""


def test_apps_apply_creates_then_leaves_unchanged(cli, nats_url, tmp_path: Path):
    spec = tmp_path / "zattera.toml"
    spec.write_text(VALID)
    first = cli("apps", "apply", str(spec), "--json")
    assert first.exit_code == 0, first.output
    created = json.loads(first.stdout)
    assert {"project demo", "app hello", "env production", "env staging", "domain hello.example.com"} <= set(
        created["created"]
    )
    again = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert again["created"] == [] and again["updated"] == []

    async def check(conn, view, writer):
        env = view.env(created["env_ids"]["production"])
        assert env.service.replicas.min == 2 and env.service.command == "python app.py"
        assert env.service.healthcheck.interval.seconds == 2
        staging = view.env(created["env_ids"]["staging"])
        assert staging.effective_replicas == 1 and staging.idle_timeout.seconds == 600
        assert [d.hostname for d in view.domains(env.meta.id)] == ["hello.example.com"]

    state(nats_url, check)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('project = "Demo"\napp = "a"\n[env.p]\n', "project"),
        ('project = "d"\napp = "a"\n[env.p]\nreplicas = { min = 3, max = 2 }\n', "env.p.replicas"),
        ('project = "d"\napp = "a"\n[env.p]\nscale_to_zero = true\nstateful = true\n', "env.p"),
        ('project = "d"\napp = "a"\n[env.p]\nidle_timeout = "soon"\n', "env.p.idle_timeout"),
        ('project = "d"\napp = "a"\n[env.p]\nmin_healthy_time = "11m"\n', "env.p.min_healthy_time"),
        ('project = "d"\napp = "a"\n[env.p]\nmin_healthy_time = -1\n', "env.p.min_healthy_time"),
        ('project = "d"\napp = "a"\n[env.p]\nhealthcheck = { type = "exec" }\n', "env.p.healthcheck"),
        ('project = "d"\napp = "a"\n[env.p]\nbogus = 1\n', "env.p.bogus"),
        ('project = "d"\napp = "a"\n', "env"),
    ],
)
def test_invalid_spec_is_refused_naming_the_field(cli, tmp_path: Path, body: str, field: str):
    spec = tmp_path / "zattera.toml"
    spec.write_text(body)
    result = cli("apps", "apply", str(spec))
    assert result.exit_code == 1
    assert f": {field}:" in result.stderr


def test_node_commands_change_the_node(cli, nats_url):
    async def seed(conn, view, writer):
        await writer.commit(writer.txn().create(node("n1")))

    state(nats_url, seed)
    assert cli("nodes", "cordon", "n1").exit_code == 0
    assert cli("nodes", "label", "n1", "region=eu", "disk=ssd").exit_code == 0
    listed = json.loads(cli("nodes", "list", "--json").stdout)
    assert listed[0]["schedulable"] is False and listed[0]["labels"]["region"] == "eu"
    assert cli("nodes", "drain", "n1").exit_code == 0
    assert json.loads(cli("nodes", "list", "--json").stdout)[0]["status"] == "NODE_STATUS_DRAINING"
    missing = cli("nodes", "cordon", "nope")
    assert missing.exit_code == 1 and "not found" in missing.stderr
    bad = cli("nodes", "label", "n1", "novalue")
    assert bad.exit_code == 1 and "labels:" in bad.stderr


def test_deploy_image_then_list_and_cancel(cli, tmp_path: Path):
    spec = tmp_path / "zattera.toml"
    spec.write_text(VALID)
    assert cli("apps", "apply", str(spec)).exit_code == 0
    result = cli("deploy", "--env", "demo/hello/production", "--image", "registry/hello:1", "--no-watch")
    assert result.exit_code == 0, result.stderr
    deployment_id = result.stdout.strip()
    listed = json.loads(cli("deploy", "list", "--json").stdout)
    assert [d["meta"]["id"] for d in listed] == [deployment_id]
    blocked = cli("deploy", "--env", "demo/hello/production", "--image", "registry/hello:2", "--no-watch")
    assert blocked.exit_code == 1 and "already in progress" in blocked.stderr
    assert cli("deploy", "cancel", deployment_id).exit_code == 0
    releases = json.loads(cli("releases", "--env", "demo/hello/production", "--json").stdout)
    assert releases[0]["version"] == "1"  # uint64 is a string in canonical protobuf JSON


def test_unknown_environment_names_the_option(cli):
    result = cli("deploy", "--env", "no/such/env", "--image", "x:1", "--no-watch")
    assert result.exit_code == 1 and "--env" in result.stderr


def test_rollback_without_previous_release_is_refused(cli, tmp_path: Path):
    spec = tmp_path / "zattera.toml"
    spec.write_text(VALID)
    cli("apps", "apply", str(spec))
    result = cli("rollback", "--env", "demo/hello/production", "--no-watch")
    assert result.exit_code == 1 and "no previous release" in result.stderr


def test_events_lists_published_events(cli, nats_url):
    async def publish(conn, view, writer):
        await EventPublisher(conn).publish(make_event("node.down", "node n1 is down", node_id="n1"))

    state(nats_url, publish)
    result = cli("events", "--json", "--last", "5")
    assert result.exit_code == 0
    assert '"kind": "node.down"' in result.stdout


def test_ps_shows_assignments_with_observed_state(cli, nats_url):
    async def seed(conn, view, writer):
        a = pb.Assignment(node_id="n1", environment_id="e1", release_id="r1", desired=pb.ASSIGNMENT_DESIRED_RUN)
        a.meta.id = "A1"
        await writer.commit(writer.txn().create(a))
        await writer.commit(
            writer.txn().put(pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY), key=K.observed("n1", "A1"))
        )

    state(nats_url, seed)
    rows = json.loads(cli("ps", "--json").stdout)
    assert rows[0]["observed"]["state"] == "INSTANCE_STATE_HEALTHY"


def test_cli_reports_unreachable_nats_clearly():
    result = CliRunner().invoke(app, ["--nats", "nats://127.0.0.1:1", "nodes", "list"])
    assert result.exit_code == 3 and "cannot reach NATS" in result.stderr


def test_volume_commands_name_the_missing_volume_or_snapshot(cli):
    missing = cli("volumes", "snapshot", "nope")
    assert missing.exit_code == 1 and "volume 'nope' not found" in missing.stderr
    refused = cli("volumes", "restore", "nope", "snap")
    assert refused.exit_code == 1 and "restore refused or failed" in refused.stderr


STATEFUL = """
project = "demo"
app = "db"

[env.production]
stateful = true

[[env.production.volumes]]
volume_name = "data"
mount_path = "/data"
snapshot_schedule = "0 3 * * *"
snapshot_keep_last = 14
"""


def _seed_volume(nats_url: str, env_id: str, project_id: str, volume_id: str = "VOL1") -> None:
    async def seed(conn, view, writer):
        volume = pb.Volume(project_id=project_id, environment_id=env_id, name="data", node_id="n1")
        volume.status = pb.VOLUME_STATUS_ACTIVE
        volume.meta.id = volume_id
        await writer.commit(writer.txn().create(volume))

    state(nats_url, seed)


def _policy(nats_url: str, volume_id: str = "VOL1") -> pb.SnapshotPolicy:
    async def read(conn, view, writer):
        return view.volume(volume_id).snapshot_policy

    return state(nats_url, read)


def test_apply_writes_the_snapshot_policy_onto_the_env_volumes(cli, nats_url, tmp_path: Path):
    """Before: zattera.toml's snapshot_schedule / snapshot_keep_last were validated, then dropped."""
    spec = tmp_path / "zattera.toml"
    spec.write_text(STATEFUL)
    first = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert first["pending"] == ["volume production/data snapshot policy"]  # the first deploy creates it
    _seed_volume(nats_url, first["env_ids"]["production"], first["project_id"])

    human = cli("apps", "apply", str(spec))
    assert human.exit_code == 0
    assert any(line.startswith("~ volume policy demo/db/production:data") for line in human.stdout.splitlines())
    assert '      schedule: (none) → "0 3 * * *"' in human.stdout.splitlines()
    policy = _policy(nats_url)
    assert (policy.schedule, policy.keep_last, policy.pre_hook) == ("0 3 * * *", 14, "")

    # A key absent from the file leaves the field as `zattera volumes policy` set it.
    assert cli("volumes", "policy", "VOL1", "--pre-hook", "sync").exit_code == 0
    again = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert again["updated"] == [] and "volume production/data snapshot policy" in again["unchanged"]
    assert _policy(nats_url).pre_hook == "sync"
    spec.write_text(STATEFUL.replace('"0 3 * * *"', '"@every 6h"'))
    assert cli("apps", "apply", str(spec)).exit_code == 0
    policy = _policy(nats_url)
    assert (policy.schedule, policy.keep_last, policy.pre_hook) == ("@every 6h", 14, "sync")


def test_volumes_policy_sets_only_the_given_fields_and_validates_them(cli, nats_url):
    _seed_volume(nats_url, "e1", "p1")
    result = cli("volumes", "policy", "VOL1", "--schedule", "CRON_TZ=Europe/Rome 30 2 * * *", "--keep-last", "3")
    assert result.exit_code == 0, result.stderr
    assert "keep last 3" in result.stderr
    hooked = json.loads(cli("volumes", "policy", "VOL1", "--pre-hook", "pg_dump db > dump.sql", "--json").stdout)
    assert hooked == {
        "schedule": "CRON_TZ=Europe/Rome 30 2 * * *",
        "pre_hook": "pg_dump db > dump.sql",
        "keep_last": 3,
        "offsite": "",
        "offsite_settings": [],
    }
    manual = json.loads(cli("volumes", "policy", "VOL1", "--schedule", "", "--json").stdout)
    assert manual["schedule"] == "" and manual["keep_last"] == 3
    listed = json.loads(cli("volumes", "list", "--json").stdout)
    assert listed[0]["snapshot_policy"]["pre_hook"] == "pg_dump db > dump.sql"

    bad = cli("volumes", "policy", "VOL1", "--schedule", "every day")
    assert bad.exit_code == 1 and "--schedule: expected exactly 5 fields" in bad.stderr
    nothing = cli("volumes", "policy", "VOL1")
    assert nothing.exit_code == 1 and "at least one of" in nothing.stderr
    missing = cli("volumes", "policy", "nope", "--keep-last", "1")
    assert missing.exit_code == 1 and "volume 'nope' not found" in missing.stderr


def test_bad_snapshot_schedule_in_the_spec_is_refused_naming_the_field(cli, tmp_path: Path):
    spec = tmp_path / "zattera.toml"
    spec.write_text(STATEFUL.replace('"0 3 * * *"', '"0 0 3 * * *"'))  # 6 fields (seconds): not accepted
    result = cli("apps", "apply", str(spec))
    assert result.exit_code == 1
    assert ": env.production.volumes.0.snapshot_schedule: " in result.stderr


def test_volumes_snapshots_lists_the_ids_restore_takes_newest_first(cli, nats_url):
    """Before: `volumes list` showed only a count, so `volumes restore VOL SNAPSHOT` had no id to use."""

    async def seed(conn, view, writer):
        txn = writer.txn()
        for snapshot_id, volume_id, at, status in [
            ("SNAPOLD", "VOL1", 100, pb.SNAPSHOT_STATUS_COMPLETE),
            ("SNAPNEW", "VOL1", 300, pb.SNAPSHOT_STATUS_FAILED),
            ("SNAPMID", "VOL1", 200, pb.SNAPSHOT_STATUS_COMPLETE),
            ("SNAPOTHER", "VOL2", 400, pb.SNAPSHOT_STATUS_COMPLETE),
        ]:
            record = pb.VolumeSnapshot(volume_id=volume_id, status=status, logical_size_bytes=4096, uploaded_bytes=1024)
            record.meta.id = snapshot_id
            record.meta.created_at.FromSeconds(1_700_000_000 + at)
            if status == pb.SNAPSHOT_STATUS_FAILED:
                record.error = "pre-hook exited 3"
            txn.create(record)
        await writer.commit(txn)

    _seed_volume(nats_url, "e1", "p1")
    state(nats_url, seed)
    rows = json.loads(cli("volumes", "snapshots", "VOL1", "--json").stdout)
    assert [r["meta"]["id"] for r in rows] == ["SNAPNEW", "SNAPMID", "SNAPOLD"]
    assert rows[0]["status"] == "SNAPSHOT_STATUS_FAILED" and rows[1]["logical_size_bytes"] == "4096"
    table = cli("volumes", "snapshots", "VOL1")
    assert table.exit_code == 0
    for text in ("SNAPNEW", "SNAPMID", "SNAPOLD", "complete", "failed", "4,096 B", "pre-hook"):
        assert text in table.stdout
    assert "SNAPOTHER" not in table.stdout
    missing = cli("volumes", "snapshots", "nope")
    assert missing.exit_code == 1 and "volume 'nope' not found" in missing.stderr


def test_version_needs_no_cluster() -> None:
    result = CliRunner().invoke(app, ["--nats", "nats://127.0.0.1:1", "--version"])
    assert result.exit_code == 0 and result.stdout == f"zattera {metadata.version('zattera')}\n"
