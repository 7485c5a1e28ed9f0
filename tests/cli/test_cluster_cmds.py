"""Owned cluster configuration (docs/cluster.md) on one real server: ``zattera cluster init`` records it once,
later provisioning creates only what is missing from it, a mismatch is reported and never applied, and the
CLI changes nothing; saved contexts; exit codes."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result
from zattera.v1 import types_pb2 as pb

from cli.main import app
from shared import keys as K
from shared.connection import connect
from shared.provisioning import provision
from shared.streams import ClusterConfig, live_stream_config, state_stream_config
from shared.subjects import LIVE_STREAM, STATE_PREFIX, STATE_STREAM

Invoke = Callable[..., Result]


@pytest.fixture
def cli(nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Invoke:
    monkeypatch.setenv("ZATTERA_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("ZATTERA_NATS_URL", raising=False)
    runner = CliRunner()

    def invoke(*args: str, nats: str | None = nats_url) -> Result:
        return runner.invoke(app, [*(["--nats", nats] if nats else []), *args])

    return invoke


def _stream_replicas_and_age(nats_url: str, stream: str) -> tuple[int, float]:
    async def go() -> tuple[int, float]:
        conn = await connect(nats_url, name="t")
        try:
            info = await conn.js.stream_info(stream)
            return info.config.num_replicas or 1, info.config.max_age or 0.0
        finally:
            await conn.close()

    return asyncio.run(go())


def test_commands_on_an_uninitialised_cluster_ask_for_init_and_create_nothing(cli: Invoke, nats_url: str) -> None:
    result = cli("nodes", "list")
    assert result.exit_code == 4, result.output
    assert "zattera cluster init" in result.stderr and "Traceback" not in result.output
    status = cli("cluster", "status")
    assert status.exit_code == 4


def test_init_records_the_configuration_once_and_a_second_init_changes_nothing(cli: Invoke, nats_url: str) -> None:
    first = cli("cluster", "init", "--json")
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert report["initialized"] and report["config"]["replicas"] == 1 and report["mismatches"] == []
    again = cli("cluster", "init")
    assert again.exit_code == 0 and "already initialised: replicas=1" in again.stdout
    refused = cli("cluster", "init", "--replicas", "3")
    assert refused.exit_code == 1 and "--replicas 3" in refused.stderr and "replicas=1" in refused.stderr
    assert _stream_replicas_and_age(nats_url, STATE_STREAM)[0] == 1
    status = json.loads(cli("cluster", "status", "--json").stdout)
    assert status["config"]["replicas"] == 1 and status["mismatches"] == []
    assert {s["name"] for s in status["streams"]} >= {STATE_STREAM, LIVE_STREAM, "OBJ_zattera-images"}


async def test_provisioning_with_other_settings_creates_only_what_is_missing_from_the_recorded_configuration(
    nats_url: str,
) -> None:
    conn = await connect(nats_url, name="t")
    try:
        first = await provision(conn.js, live_ttl=30.0)
        assert first.initialized and first.config.live_ttl == 30.0
        await conn.js.delete_stream(LIVE_STREAM)
        # another process with other settings (as a CLI with defaults used to be): nothing is changed
        other = await provision(conn.js, replicas=3, live_ttl=90.0)
        assert not other.initialized and other.created == [LIVE_STREAM]
        assert other.mismatches == ["replicas 3 requested, recorded 1: not applied"]
        live = await conn.js.stream_info(LIVE_STREAM)
        assert live.config.max_age == 30.0  # re-created from the recorded configuration, not the caller's
        # a stream changed by other means is reported, never put back
        await conn.js.update_stream(live_stream_config(1, 120.0))
        report = await provision(conn.js)
        assert report.mismatches == [f"{LIVE_STREAM}: max_age is 120.0, recorded 30.0"]
        assert (await conn.js.stream_info(LIVE_STREAM)).config.max_age == 120.0
    finally:
        await conn.close()


async def test_a_cluster_provisioned_before_the_configuration_was_recorded_is_described_by_its_state_stream(
    nats_url: str,
) -> None:
    conn = await connect(nats_url, name="t")
    try:
        await conn.js.add_stream(state_stream_config(1, 600.0))
        report = await provision(conn.js, tombstone_ttl=900.0)
        assert report.config == ClusterConfig(replicas=1, tombstone_ttl=600.0)
        assert not report.initialized and report.mismatches == []
    finally:
        await conn.close()


def test_status_names_the_loop_each_lease_leads(cli: Invoke, nats_url: str) -> None:
    assert cli("cluster", "init").exit_code == 0

    async def lead() -> None:
        conn = await connect(nats_url, name="t")
        try:
            lease = pb.Lease(holder="scheduler@test", version="9.9.9")
            await conn.js.publish(f"{STATE_PREFIX}{K.lease('scheduler')}", lease.SerializeToString())
        finally:
            await conn.close()

    asyncio.run(lead())
    status = json.loads(cli("cluster", "status", "--json").stdout)
    assert {"loop": "scheduler", "holder": "scheduler@test", "version": "9.9.9"} in status["leaders"]


def test_the_cli_never_changes_a_stream(cli: Invoke, nats_url: str) -> None:
    assert cli("cluster", "init").exit_code == 0

    async def shorten_live() -> None:
        conn = await connect(nats_url, name="t")
        try:
            await conn.js.update_stream(live_stream_config(1, 5.0))
        finally:
            await conn.close()

    asyncio.run(shorten_live())
    assert cli("nodes", "list").exit_code == 0
    assert cli("deploy", "list").exit_code == 0
    assert _stream_replicas_and_age(nats_url, LIVE_STREAM) == (1, 5.0)
    status = json.loads(cli("cluster", "status", "--json").stdout)
    assert status["mismatches"] == [f"{LIVE_STREAM}: max_age is 5.0, recorded 60.0"]


def test_contexts_are_saved_privately_and_used_when_no_url_is_given(cli: Invoke, nats_url: str, tmp_path: Path) -> None:
    assert cli("cluster", "init").exit_code == 0
    assert cli("context", "add", "broken", "--nats", "not-a-url", nats=None).exit_code == 1
    missing_creds = cli("context", "add", "x", "--nats", nats_url, "--creds", str(tmp_path / "nope"), nats=None)
    assert missing_creds.exit_code == 1 and "--creds" in missing_creds.stderr
    added = cli("context", "add", "local", "--nats", nats_url, nats=None)
    assert added.exit_code == 0 and "in use" in added.stdout
    assert cli("context", "add", "elsewhere", "--nats", "nats://127.0.0.1:1", nats=None).exit_code == 0
    saved = tmp_path / "config" / "contexts.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    listed = json.loads(cli("context", "list", "--json", nats=None).stdout)
    assert [(c["name"], c["current"]) for c in listed] == [("elsewhere", False), ("local", True)]
    assert cli("nodes", "list", "--json", nats=None).exit_code == 0  # reached through the context
    assert cli("context", "use", "elsewhere", nats=None).exit_code == 0
    unreachable = cli("nodes", "list", nats=None)
    assert unreachable.exit_code == 3 and "nats://127.0.0.1:1" in unreachable.stderr
    assert cli("nodes", "list", nats=nats_url).exit_code == 0  # --nats wins over the context
    assert cli("context", "use", "nope", nats=None).exit_code == 1
    assert cli("context", "remove", "elsewhere", nats=None).exit_code == 0
    assert [c["name"] for c in json.loads(cli("context", "list", "--json", nats=None).stdout)] == ["local"]
