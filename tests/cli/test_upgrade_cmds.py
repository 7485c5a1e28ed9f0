"""The operator's view of versions and upgrades, through the real CLI on a real server: ``zattera cluster
upgrade`` (dry run, run, refusal of a downgrade), ``cluster status`` (schema, migrations, leaders' versions),
``nodes list`` (each node's version against the cluster's) and the CLI's own skew check before it writes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from cli.main import app
from shared.connection import connect
from shared.migrations.registry import SCHEMA
from shared.migrations.runner import record
from shared.provisioning import provision, recorded_config
from shared.state.feed import StateView
from shared.subjects import STATE_STREAM
from shared.txn import Writer
from shared.version import VERSION
from tests import factories
from tests.compat.releases import PRE_0_1, recreate

Invoke = Callable[..., Result]


@pytest.fixture
def cli(nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Invoke:
    monkeypatch.setenv("ZATTERA_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("ZATTERA_NATS_URL", raising=False)
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(app, ["--nats", nats_url, *args])

    return invoke


def _on(nats_url: str, work: Callable[..., object]) -> None:
    async def go() -> None:
        conn = await connect(nats_url, name="t")
        try:
            await work(conn)  # type: ignore[misc]
        finally:
            await conn.close()

    asyncio.run(go())


def _record(nats_url: str, **changes: object) -> None:
    """Make the cluster say it is at another schema/version (as a newer or older release would have)."""

    async def edit(conn: object) -> None:
        now = await recorded_config(conn.js)  # type: ignore[attr-defined]
        assert now is not None
        await record(conn, dataclasses.replace(now, **changes))  # type: ignore[arg-type]

    _on(nats_url, edit)


def _stream_sequence(nats_url: str) -> int:
    found: list[int] = []

    async def read(conn: object) -> None:
        found.append((await conn.js.stream_info(STATE_STREAM)).state.last_seq)  # type: ignore[attr-defined]

    _on(nats_url, read)
    return found[0]


def test_cluster_upgrade_lists_then_runs_the_pending_migrations_and_status_shows_them(
    cli: Invoke, nats_url: str
) -> None:
    _on(nats_url, lambda conn: recreate(conn, PRE_0_1))
    dry = json.loads(cli("cluster", "upgrade", "--dry-run", "--json").stdout)
    assert dry["schema"] == 0 and dry["target"] == SCHEMA
    assert dry["pending"][0]["migration"] == "0001 build-events-per-sender"
    text = cli("cluster", "upgrade", "--dry-run")
    assert "pending: 0001 build-events-per-sender:" in text.stdout
    assert json.loads(cli("cluster", "upgrade", "--dry-run", "--json").stdout)["pending"]  # nothing ran

    ran = cli("cluster", "upgrade", "--json")
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.stdout)
    assert report["before"] == {"schema": 0, "version": ""}
    assert report["after"] == {"schema": SCHEMA, "version": VERSION}
    assert report["applied"][0]["label"] == "0001 build-events-per-sender"
    assert any("subjects" in change for change in report["applied"][0]["changes"])
    again = cli("cluster", "upgrade")
    assert again.exit_code == 0 and f"nothing to do: schema {SCHEMA} (Zattera {VERSION})" in again.stdout

    status = cli("cluster", "status")
    assert f"schema {SCHEMA} (Zattera {VERSION}); this zattera: {VERSION}, schema {SCHEMA}" in status.stdout
    assert "migrations run" in status.stdout and "0001" in status.stdout
    listed = json.loads(cli("cluster", "status", "--json").stdout)
    assert listed["config"]["schema"] == SCHEMA and listed["cli"] == {
        "version": VERSION,
        "schema": SCHEMA,
        "skew": "ok",
    }


def test_cluster_upgrade_refuses_a_downgrade_in_one_line(cli: Invoke, nats_url: str) -> None:
    assert cli("cluster", "init").exit_code == 0
    _record(nats_url, schema=SCHEMA + 2, version="0.9.0")
    refused = cli("cluster", "upgrade")
    assert refused.exit_code == 1
    assert refused.stderr.strip().count("\n") == 0 and "downgrades are refused" in refused.stderr
    assert "Traceback" not in refused.output


def test_the_cli_writes_nothing_to_a_cluster_it_is_too_old_or_too_new_for(
    cli: Invoke, nats_url: str, tmp_path: Path
) -> None:
    assert cli("cluster", "init").exit_code == 0
    spec = tmp_path / "zattera.toml"
    spec.write_text('project = "p"\napp = "a"\n[env.prod]\n')
    _record(nats_url, schema=SCHEMA + 3, version="0.4.0")
    before = _stream_sequence(nats_url)
    old = cli("apps", "apply", str(spec))
    assert old.exit_code == 1, old.output
    assert "is too old for the cluster (Zattera 0.4.0" in old.stderr and "nothing was written" in old.stderr
    assert _stream_sequence(nats_url) == before
    assert cli("apps", "list").exit_code == 0  # reads are not refused

    _on(nats_url, _reset)  # a cluster the previous release made (nothing recorded): the CLI is ahead of it
    _on(nats_url, lambda conn: recreate(conn, PRE_0_1))
    ahead = cli("apps", "apply", str(spec))
    assert ahead.exit_code == 1 and "upgrade the control plane first" in ahead.stderr
    assert cli("cluster", "upgrade").exit_code == 0
    assert cli("apps", "apply", str(spec)).exit_code == 0


async def _reset(conn: object) -> None:
    for info in await conn.js.streams_info():  # type: ignore[attr-defined]
        await conn.js.delete_stream(info.config.name)  # type: ignore[attr-defined]


def test_nodes_list_shows_each_nodes_version_against_the_clusters(cli: Invoke, nats_url: str) -> None:
    async def nodes(conn: object) -> None:
        await provision(conn.js)  # type: ignore[attr-defined]
        view = StateView(conn, name="t")  # type: ignore[arg-type]
        await view.start()
        try:
            txn = Writer(conn, view).txn()  # type: ignore[arg-type]
            for node_id, version in (("n-now", VERSION), ("n-behind", "0.1.0"), ("n-ancient", "0.0.1")):
                node = factories.node(node_id)
                node.binary_version = version
                txn.put(node)
            await Writer(conn, view).commit(txn)  # type: ignore[arg-type]
        finally:
            await view.stop()

    _on(nats_url, nodes)
    listed = cli("nodes", "list")
    rows = {line.split()[1]: line for line in listed.stdout.splitlines() if line.startswith("│ n-")}
    assert f"{VERSION} " in rows["n-now"] and "(" not in rows["n-now"].split(VERSION)[1].split("│")[0]
    assert "0.1.0 (behind)" in rows["n-behind"]
    assert "0.0.1 (too old)" in rows["n-ancient"]
