"""``zattera addons psql`` from a machine that is not the database's node: a real PostgreSQL (the add-on's
entry script), a real nats-server, the node's tunnel agent (shared/addons/tunnel.py) and the real ``psql``
on a private local socket. Results larger than the flow-control window come back whole and in order, data
sent the other way arrives whole, refusals are one line, and no password is needed or shown anywhere."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shared.addons import tunnel
from shared.addons.tunnel import TunnelAgent, TunnelError, check_reachable, run_psql
from shared.connection import Connection
from tests.addons.pgserver import PG_BIN, PgInstance, require_servers

NODE = "n-db"


@pytest.fixture
def db() -> Iterator[PgInstance]:
    require_servers()
    root = Path(tempfile.mkdtemp(prefix="zattera-psql-"))
    root.chmod(0o755)
    # the data volume is <volumes root>/data: volume id "data", volumes root = root
    instance = PgInstance(root, "orders")
    instance.start()
    yield instance
    instance.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def agent(conn: Connection, db: PgInstance) -> AsyncIterator[TunnelAgent]:
    served = TunnelAgent(conn, NODE, db.root)
    await served.start()
    yield served
    await served.stop()


async def _psql(conn: Connection, out: Path, *args: str) -> tuple[int, str]:
    with out.open("wb") as sink:
        code = await run_psql(
            conn, NODE, "data", ["-X", "-q", "-At", "-d", "app", *args], psql=f"{PG_BIN}/psql", stdout=sink
        )
    return code, await asyncio.to_thread(out.read_text)


async def test_a_session_through_nats_as_the_superuser_without_a_password(
    conn: Connection, agent: TunnelAgent, db: PgInstance, tmp_path: Path
) -> None:
    code, out = await _psql(conn, tmp_path / "out", "-c", "select current_user, inet_server_addr() is null")
    assert (code, out.strip()) == (0, "postgres|t")  # the server's own socket: a local connection, no password
    # Several round trips and statements in one session, tables the app role owns.
    code, out = await _psql(
        conn,
        tmp_path / "out",
        "-c",
        "create table t(x int primary key, pad text)",
        "-c",
        "insert into t select g, repeat('p', 100) from generate_series(1, 1000) g",
        "-c",
        "select count(*) from t",
    )
    assert code == 0 and out.split() == ["1000"], out
    assert db.sql("select count(*) from t", user="postgres") == ["1000"]  # the same server, seen directly


async def test_large_results_and_large_input_come_through_whole_and_in_order(
    conn: Connection, agent: TunnelAgent, db: PgInstance, tmp_path: Path
) -> None:
    # ~6 MiB back: several times the window, so the credit (A frames) is exercised
    query = "select g, md5(g::text) from generate_series(1, 150000) g order by g"
    code, out = await _psql(conn, tmp_path / "big", "-c", query)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 150000
    assert lines[0].startswith("1|") and lines[-1].startswith("150000|")
    assert [int(line.split("|")[0]) for line in lines] == list(range(1, 150001))
    # ~3 MiB the other way: one statement larger than the window
    script = tmp_path / "in.sql"
    script.write_text("create table blob(v text);\ninsert into blob values ('" + "z" * 3_000_000 + "');\n")
    code, out = await _psql(conn, tmp_path / "out", "-f", str(script), "-c", "select length(v) from blob")
    assert code == 0 and out.split() == ["3000000"], out[-200:]


async def test_refusals_are_one_line(
    conn: Connection, agent: TunnelAgent, db: PgInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TunnelError, match="no PostgreSQL server socket for volume nope on node n-db"):
        await check_reachable(conn, NODE, "nope")
    with pytest.raises(TunnelError, match="plain ids"):
        await check_reachable(conn, NODE, "../etc")
    monkeypatch.setattr(tunnel, "OPEN_TIMEOUT", 0.5)
    with pytest.raises(TunnelError, match="no agent answers for node n-gone"):
        await check_reachable(conn, "n-gone", "data")


async def test_no_password_anywhere(
    conn: Connection, agent: TunnelAgent, db: PgInstance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    code, _out = await _psql(conn, tmp_path / "out", "-c", "select 1")
    assert code == 0
    for secret in (db.superuser_password, db.app_password):
        assert secret not in caplog.text
        assert secret not in (tmp_path / "out").read_text()
