"""``zattera addons offsite`` / ``restore --from`` / ``psql`` against a real NATS server: one-line refusals
naming the argument or option as the command spells it; and ``addons psql`` run by the real CLI against a
real PostgreSQL whose node's tunnel agent runs beside it (another event loop, another connection)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared.addons import spec as addon
from shared.addons.tunnel import TunnelAgent
from shared.connection import connect
from shared.state.feed import StateView
from shared.txn import Writer
from tests import factories
from tests.addons.pgserver import PgInstance, require_servers
from tests.cli.rig import Invoke, initialised_cli, state
from tests.cli.test_config_secrets import applied, cluster_key

__all__ = ["applied", "cluster_key"]  # fixtures of the secrets CLI tests


@pytest.fixture
def cli(nats_url: str) -> Invoke:
    return initialised_cli(nats_url)


def test_offsite_restore_and_psql_refusals(cli: Invoke, applied: Path, cluster_key: PrivateKey) -> None:
    assert cli("addons", "create", "postgres", "orders", "--project", "demo").exit_code == 0
    assert cli("addons", "create", "redis", "cache", "--project", "demo").exit_code == 0
    for args, expected in [
        (("offsite", "orders", "s3://b/p", "--project", "demo"), "NAME: orders has no backups volume yet"),
        (("offsite", "cache", "s3://b/p", "--project", "demo"), "NAME: cache is not a PostgreSQL database"),
        (("offsite", "gone", "s3://b/p", "--project", "demo"), "NAME: no database 'gone' in project demo"),
        (
            ("restore", "orders", "--project", "demo", "--as", "copy", "--latest", "--from", "s3://b/p"),
            "NAME: orders has no backups volume yet",
        ),
        (("psql", "orders", "--project", "demo", "-c", "select 1"), "NAME: orders is not running yet"),
        (("psql", "cache", "--project", "demo"), "NAME: cache is a redis database; psql opens PostgreSQL ones"),
    ]:
        done = cli("addons", *args)
        assert done.exit_code == 1, (args, done.output)
        assert expected in done.output and done.output.strip().count("\n") == 0, (args, done.output)


@pytest.fixture
def db() -> Iterator[PgInstance]:
    require_servers()
    root = Path(tempfile.mkdtemp(prefix="zattera-cli-psql-"))
    root.chmod(0o755)
    instance = PgInstance(root, "orders")  # its data volume: <root>/data, volume id "data"
    instance.start()
    yield instance
    instance.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def node_agent(nats_url: str, db: PgInstance) -> Iterator[None]:
    """The database node's tunnel agent, in a thread of its own (the CLI runs its own event loop)."""
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()

    async def serve() -> None:
        conn = await connect(nats_url, name="agent")
        agent = TunnelAgent(conn, "n-db", db.root)
        await agent.start()
        started.set()
        await stop.wait()
        await agent.stop()
        await conn.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(30)
    yield
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


def test_psql_through_the_cli_from_another_machine(
    cli: Invoke, applied: Path, cluster_key: PrivateKey, nats_url: str, db: PgInstance, node_agent: None
) -> None:
    assert cli("addons", "create", "postgres", "orders", "--project", "demo").exit_code == 0

    async def place(conn: Any, view: StateView, writer: Writer) -> None:
        env = next(e for e in view.envs() if e.service.vars.get(addon.ADDON_VAR, "").startswith("postgres"))
        volume = pb.Volume(
            project_id=env.project_id, environment_id=env.meta.id, name=addon.DATA_VOLUME, node_id="n-db"
        )
        volume.meta.id = "data"
        running = factories.assignment("n-db", env.meta.id, env.active_release_id or "01REL", assignment_id="01A")
        await writer.commit(writer.txn().create(volume).create(running))

    state(nats_url, place)
    done = cli("addons", "psql", "orders", "--project", "demo", "-c", "create table made_from_the_cli(x int)")
    assert done.exit_code == 0, done.output
    assert db.sql("select count(*) from made_from_the_cli", user="postgres") == ["0"]
    for secret in (db.superuser_password, db.app_password):
        assert secret not in done.output
