"""``[[env.<name>.cron]]`` in zattera.toml (validation naming the field, nothing written on bad input) and
``zattera jobs list/show/cancel`` against a real NATS server (docs/jobs.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from cli.spec import SpecError, validate
from shared import jobs as J
from tests.cli.rig import state

BASE = {"project": "d", "app": "a"}
GOOD = {"name": "nightly", "schedule": "CRON_TZ=Europe/Rome 30 2 * * *", "command": "python task.py"}

CRON_TOML = """
project = "demo"
app = "hello"

[env.production]
[[env.production.cron]]
name = "nightly"
schedule = "{schedule}"
command = "python manage.py clearsessions"
concurrency = "REPLACE"
max_retries = 2
deadline = "10m"
resources = {{ cpu_millis = 500, memory_mb = 256 }}
"""


def _spec_with(**entry: object) -> dict[str, object]:
    return {**BASE, "env": {"p": {"cron": [{**GOOD, **entry}]}}}


@pytest.mark.parametrize(
    ("entry", "field", "says"),
    [
        ({"schedule": "61 * * * *"}, "env.p.cron.0.schedule", "bad cron expression"),
        ({"schedule": "* * * *"}, "env.p.cron.0.schedule", "expected exactly 5 fields"),
        ({"schedule": ""}, "env.p.cron.0.schedule", "must not be empty"),
        ({"schedule": "CRON_TZ=Mars/Base 0 3 * * *"}, "env.p.cron.0.schedule", "unknown time zone 'Mars/Base'"),
        ({"schedule": "@every 10x"}, "env.p.cron.0.schedule", "bad duration"),
        ({"concurrency": "sometimes"}, "env.p.cron.0.concurrency", "'forbid', 'replace' or 'allow'"),
        ({"command": "x" * (J.MAX_COMMAND_BYTES + 1)}, "env.p.cron.0.command", "over the 4096-byte limit"),
        ({"command": "  "}, "env.p.cron.0.command", "must not be empty"),
        ({"max_retries": 11}, "env.p.cron.0.max_retries", "less than or equal to 10"),
        ({"deadline": "soon"}, "env.p.cron.0.deadline", "not a duration"),
        ({"deadline": 0}, "env.p.cron.0.deadline", "greater than 0"),
        ({"name": "Nightly!"}, "env.p.cron.0.name", "lowercase letters, digits and dashes"),
        ({"every": "1h"}, "env.p.cron.0.every", "unknown key"),
    ],
)
def test_bad_cron_entries_are_refused_naming_the_field(entry: dict[str, object], field: str, says: str) -> None:
    with pytest.raises(SpecError) as refused:
        validate(_spec_with(**entry))
    assert f": {field}: " in str(refused.value) and says in str(refused.value)


def test_cron_entry_names_are_unique() -> None:
    raw = {**BASE, "env": {"p": {"cron": [GOOD, GOOD]}}}
    with pytest.raises(SpecError, match=r"env\.p\.cron: cron entry names must be unique"):
        validate(raw)


def test_apply_writes_cron_entries_and_keeps_their_start_while_the_schedule_stays(
    cli,
    nats_url: str,
    tmp_path: Path,
) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(CRON_TOML.format(schedule="@every 1h"))
    result = cli("apps", "apply", str(spec), "--json")
    assert result.exit_code == 0, result.output
    env_id = json.loads(result.stdout)["env_ids"]["production"]

    async def entry(conn, view, writer) -> pb.CronSpec:
        [cron] = view.env(env_id).service.cron
        return cron

    first = state(nats_url, entry)
    assert (first.name, first.schedule, first.concurrency, first.max_retries) == (
        "nightly",
        "@every 1h",
        pb.CONCURRENCY_POLICY_REPLACE,
        2,
    )
    assert (first.deadline.seconds, first.resources.cpu_millis, first.resources.memory_mb) == (600, 500, 256)
    assert first.since.seconds > 0
    again = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert again["updated"] == []  # the same schedule keeps its start
    spec.write_text(CRON_TOML.format(schedule="@every 2h"))
    assert "env production" in json.loads(cli("apps", "apply", str(spec), "--json").stdout)["updated"]


def test_a_bad_cron_entry_writes_nothing(cli, nats_url: str, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(CRON_TOML.format(schedule="CRON_TZ=Nowhere/Land 0 3 * * *"))
    result = cli("apps", "apply", str(spec))
    assert result.exit_code == 1
    assert "env.production.cron.0.schedule: unknown time zone 'Nowhere/Land'" in result.stderr

    async def nothing(conn, view, writer) -> None:
        assert view.envs() == []

    state(nats_url, nothing)


def test_jobs_list_show_and_cancel(cli, nats_url: str) -> None:
    env = pb.Environment(project_id="P1", app_id="A1", name="production", active_release_id="01RELEASE3")
    env.meta.id = "E1"
    release = pb.Release(environment_id="E1", version=3)
    release.meta.id = "01RELEASE3"
    running = J.one_off_job(env, "python manage.py migrate", now=1_900_000_000)
    running.status, running.node_id, running.assignment_id = J.RUNNING, "n1", "A-1"
    done = J.one_off_job(env, "true", now=1_900_000_100)
    done.cron_name, done.status, done.exit_code_known = "nightly", J.SUCCEEDED, True
    done.release_id = release.meta.id  # placed on the active release
    done.output_tail.extend(["42 rows"])

    async def seed(conn, view, writer) -> None:
        await writer.commit(writer.txn().put(env).create(release).create(running).create(done))

    state(nats_url, seed)
    listed = json.loads(cli("jobs", "list", "--json").stdout)
    assert [j["meta"]["id"] for j in listed] == [done.meta.id, running.meta.id]  # newest first
    history = json.loads(cli("jobs", "list", "--env", "E1", "--cron", "nightly", "--json").stdout)
    assert [j["meta"]["id"] for j in history] == [done.meta.id]
    table = cli("jobs", "list")
    assert table.exit_code == 0 and running.meta.id in table.stdout and "succeeded" in table.stdout
    shown = cli("jobs", "show", done.meta.id)
    assert shown.exit_code == 0 and "42 rows" in shown.stdout
    [release_row] = [line for line in shown.stdout.splitlines() if " release " in line]
    assert "v3" in release_row and "01RELEASE3" not in release_row  # named as everywhere else, not by id
    assert json.loads(cli("jobs", "show", done.meta.id, "--json").stdout)["status"] == "JOB_STATUS_SUCCEEDED"

    assert cli("jobs", "cancel", running.meta.id).exit_code == 0
    refused = cli("jobs", "cancel", done.meta.id)
    assert refused.exit_code == 1 and f"job {done.meta.id} already ended (succeeded)" in refused.stderr
    missing = cli("jobs", "show", "01JNOPE")
    assert missing.exit_code == 1 and "no job '01JNOPE'" in missing.stderr

    async def canceled(conn, view, writer) -> None:
        assert view.get("job", running.meta.id).cancel_requested

    state(nats_url, canceled)
