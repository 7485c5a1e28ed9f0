"""Losing NATS servers on a real 3-server cluster, the fast cases (``make test``; the long ones are in
``test_nats_loss.py``, ``make chaos``): the configuration recorded by ``zattera cluster init`` survives
clients and services with other settings (nothing remapped, every stream still R3), and the CLI's reads
ride out the loss of the state stream's leader, the meta leader and the server they are connected to."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from shared.connection import Connection, connect
from shared.provisioning import inspect_cluster, provision
from shared.subjects import LIVE_STREAM, STATE_STREAM
from tests.chaos.cluster import Fleet, NatsCluster
from tests.waiting import eventually

CLI_BOUND = 15.0  # cli.client.REQUEST_DEADLINE


@pytest.fixture
async def nats(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    cluster = NatsCluster(tmp_path / "nats").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def zattera(nats: NatsCluster, *args: str) -> tuple[int, str]:
    """Exit code, and stdout on success (what ``--json`` readers parse: progress goes to stderr), else
    everything printed."""
    result = CliRunner().invoke(app, ["--nats", nats.urls, *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout if result.exit_code == 0 else result.output


async def initialised(nats: NatsCluster) -> None:
    """``zattera cluster init`` with no --replicas, the moment the servers are up: three copies, from the
    cluster's size (init waits while the servers join the meta group)."""
    code, out = await asyncio.to_thread(zattera, nats, "cluster", "init", "--json")
    assert code == 0, out
    assert json.loads(out)["config"]["replicas"] == 3
    await nats.provision()  # every stream led and its replicas current before faults


@pytest.mark.timeout(120)
async def test_clients_and_services_with_other_settings_change_nothing(
    nats: NatsCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await initialised(nats)
    monkeypatch.delenv("ZATTERA_REPLICAS", raising=False)
    for command in (("nodes", "list"), ("deploy", "list", "--json"), ("cluster", "status")):
        code, out = await asyncio.to_thread(zattera, nats, *command)
        assert code == 0, out
    fleet = Fleet(nats.urls, tmp_path / "logs", env={"ZATTERA_REPLICAS": "1", "ZATTERA_LIVE_TTL": "5"})
    try:
        routes = fleet.start("routes")
        await eventually(lambda: "running" in routes.log.read_text(errors="replace"), 60, "routes running")
        log = routes.log.read_text(errors="replace")
        assert "replicas 1 requested, recorded 3: not applied" in log
    finally:
        fleet.stop_all()
    conn = await connect(nats.urls, name="check")
    try:
        config, streams = await inspect_cluster(conn.js)
        assert config is not None and config.replicas == 3 and config.live_ttl == 60.0
        assert [s.name for s in streams if s.replicas != 3 or s.mismatches] == []
    finally:
        await conn.close()
    for server in nats.servers:
        assert "remapping" not in (server.data_dir / "nats.log").read_text(errors="replace"), server.name


@pytest.mark.timeout(120)
async def test_init_waits_for_enough_servers_to_place_its_streams(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of three servers up (the third not yet joined): three-copy streams cannot be placed, so
    ``zattera cluster init`` says it waits for the third, rather than failing or creating fewer copies,
    and completes once it joins."""
    nats = NatsCluster(tmp_path / "late").start(running=2)
    try:
        with caplog.at_level(logging.INFO, logger="shared.provisioning.placement"):
            command = ["--nats", nats.urls, "cluster", "init", "--json"]  # 3 copies: three servers named
            init = asyncio.create_task(asyncio.to_thread(CliRunner().invoke, app, command))
            await eventually(lambda: "no suitable peers" in caplog.text, 30, "init waiting for a third server")
            assert not init.done()
            await asyncio.to_thread(nats.servers[2].start)
            result = await asyncio.wait_for(init, 60)
        assert result.exit_code == 0, result.output
        assert "no suitable peers for placement; waiting up to 30s" in result.stderr
        out = json.loads(result.stdout)
        assert out["initialized"] and out["config"]["replicas"] == 3 and out["mismatches"] == []
        conn = await connect(nats.servers[0].url, name="check")
        try:
            info = await conn.js.stream_info(STATE_STREAM)
            assert info.config.num_replicas == 3
        finally:
            await conn.close()
    finally:
        nats.stop()


async def _read_after_kill(nats: NatsCluster, conn: Connection, victim: int) -> None:
    """Kill ``victim``, then read through the CLI's patient client and with a whole CLI command: each
    gives up after its bounded wait, so success is the proof."""
    nats.kill(victim)
    info = await conn.js.stream_info(STATE_STREAM)
    assert info.config.num_replicas == 3
    code, out = await asyncio.to_thread(zattera, nats, "deploy", "list", "--json")
    assert code == 0, out
    nats.restart(victim)


@pytest.mark.timeout(120)
async def test_cli_reads_survive_the_loss_of_the_state_streams_leader(nats: NatsCluster) -> None:
    """The slowest case (a Raft election before the stream answers again); every role, under load, is in
    ``test_nats_loss.py``."""
    await initialised(nats)
    conn = await connect(nats.urls, name="cli-like", request_deadline=CLI_BOUND)
    try:
        await _read_after_kill(nats, conn, await nats.stream_leader(conn, STATE_STREAM))
        await nats.provision()
        live = await conn.js.stream_info(LIVE_STREAM)
        assert live.cluster is not None and all(p.current for p in live.cluster.replicas or [])
    finally:
        await conn.close()


async def test_a_second_init_with_other_replicas_is_refused_and_provision_reports_it(nats: NatsCluster) -> None:
    await initialised(nats)
    code, out = await asyncio.to_thread(zattera, nats, "cluster", "init", "--replicas", "1")
    assert code == 1 and "replicas=3" in out
    conn = await connect(nats.urls, name="check")
    try:
        report = await provision(conn.js, replicas=1)
        assert report.mismatches == ["replicas 1 requested, recorded 3: not applied"]
        assert (await conn.js.stream_info(STATE_STREAM)).config.num_replicas == 3
    finally:
        await conn.close()
