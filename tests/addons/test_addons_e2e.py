"""Managed PostgreSQL end to end: real NATS, every service, two agents (sandboxed: each env its own user),
the proxy and the real CLI. An app attached to a database writes and reads rows through its
``DATABASE_URL`` (the private network's forwarder in between); the database's replica restarts without
losing a committed row; a point-in-time fork has exactly the rows committed before the target; no
password is in any file the cluster wrote, nor in a process listing. Run through the slot (heavy)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import psutil
import pytest

from shared.snapshots.store import SnapshotStore
from tests.addons.pgserver import PG_BIN, require_servers
from tests.backup.conftest import BUCKET, SECRET_KEY, s3
from tests.e2e.cluster import E2ECluster, cli_argv
from tests.e2e.conftest import running
from tests.waiting import eventually

__all__ = ["s3"]  # the S3 server fixture of the backup tests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

HOST = "ledger.localhost"
WEB = "shop/web/production"

APP = """
import os, subprocess, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PSQL = "/usr/lib/postgresql/15/bin/psql"


def sql(query):
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        return 409, "no DATABASE_URL"
    done = subprocess.run([PSQL, "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", query],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    return (200, done.stdout) if done.returncode == 0 else (500, done.stderr)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path == "/healthz":
            code, body = 200, "ok"
        elif path == "/sql":
            code, body = sql(urllib.parse.parse_qs(query)["q"][0])
        elif path == "/url":  # the test's leak check needs the password the app was given
            code, body = 200, os.environ.get("DATABASE_URL", "") + " " + os.environ.get("PGHOST", "")
        else:
            code, body = 404, "?"
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        return


ThreadingHTTPServer((os.environ["ZATTERA_BIND_ADDR"], int(os.environ["PORT"])), Handler).serve_forever()
"""

SPEC = f"""
project = "shop"
app = "web"

[run]
command = "python3 app.py"

[env.production]
replicas = {{ min = 1, max = 1 }}
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
domains = ["{HOST}"]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    require_servers()
    yield from running(E2ECluster(tmp_path_factory.mktemp("e2e"), timers={"ZATTERA_NODE_HEARTBEAT_DEADLINE": "60"}))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("ledger-src")
    (src / "app.py").write_text(APP)
    (src / "zattera.toml").write_text(SPEC)
    return src


async def _sql(cluster: E2ECluster, query: str) -> tuple[int, str]:
    from urllib.parse import quote

    return await cluster.get(HOST, f"/sql?q={quote(query)}", timeout=40)


async def _rows(cluster: E2ECluster, query: str) -> list[str]:
    status, body = await _sql(cluster, query)
    assert status == 200, body
    return body.split()


async def _info(cluster: E2ECluster, name: str) -> dict[str, object]:
    done = await cluster.acli("addons", "info", name, "--project", "shop", "--json")
    info: dict[str, object] = json.loads(done.stdout)
    return info


async def _healthy(cluster: E2ECluster, name: str) -> bool:
    return (await _info(cluster, name))["status"] == "HEALTHY"


async def _answers(cluster: E2ECluster, query: str, expected: list[str]) -> bool:
    status, body = await _sql(cluster, query)
    return status == 200 and body.split() == expected


async def test_an_attached_app_writes_and_reads_rows_through_its_database_url(
    cluster: E2ECluster, source: Path
) -> None:
    await cluster.acli("apps", "apply", str(source / "zattera.toml"))
    await cluster.acli("deploy", str(source), "--env", WEB)
    created = await cluster.acli(
        "addons", "create", "postgres", "ledger", "--project", "shop", "--archive-timeout", "2"
    )
    assert "ledger.db.shop.internal:5432" in created.stderr, created.stderr
    await eventually(lambda: _healthy(cluster, "ledger"), 180, "the database healthy")
    attached = await cluster.acli("addons", "attach", "ledger", "--env", WEB)
    assert "attached to shop/web/production" in attached.stderr, attached.stderr
    await eventually(lambda: _answers(cluster, "select 1", ["1"]), 120, "the app reaching its database")
    await _rows(cluster, "create table entries(x text primary key)")
    await _rows(cluster, "insert into entries select 'r' || g from generate_series(1, 100) g")
    assert await _rows(cluster, "select count(*) from entries") == ["100"]
    status, url = await cluster.get(HOST, "/url")
    assert status == 200 and url.startswith("postgresql://app:") and "${" not in url, url


async def _window_reaches(cluster: E2ECluster, target: float) -> bool:
    done = await cluster.acli("addons", "backups", "ledger", "--project", "shop", "--json", check=False)
    if done.returncode != 0:
        return False
    window_end: float = json.loads(done.stdout)["window_end"]
    return window_end >= target


async def _has_a_base_backup(cluster: E2ECluster) -> bool:
    done = await cluster.acli("addons", "backups", "ledger", "--project", "shop", "--json", check=False)
    return done.returncode == 0 and bool(json.loads(done.stdout)["backups"])


async def test_a_point_in_time_fork_has_exactly_the_rows_before_the_target(cluster: E2ECluster) -> None:
    # the window opens with the first base backup (the crash above may have cut the first one short: the
    # restarted instance takes one again)
    await eventually(lambda: _has_a_base_backup(cluster), 120, "a base backup")
    await _rows(cluster, "create table pitr(x text)")
    await _rows(cluster, "insert into pitr values ('a1'), ('a2')")
    time.sleep(1.1)  # noqa: ASYNC251 - the wall clock is what the target is: a gap around it
    target = time.time()
    time.sleep(1.1)  # noqa: ASYNC251
    await _rows(cluster, "insert into pitr values ('b1')")
    # archive_timeout 2 s: the segment holding the target is archived within seconds; the instance
    # reports its window to its log every 10 s
    try:
        await eventually(lambda: _window_reaches(cluster, target + 1.5), 90, "the archive to pass the target")
    except AssertionError:
        backups = await cluster.acli("addons", "backups", "ledger", "--project", "shop", "--json", check=False)
        logs = await cluster.acli("logs", "--env", "shop/ledger/db", "-n", "60", check=False)
        stats = await _psql(
            cluster,
            "select now(), pg_walfile_name(pg_current_wal_lsn()), current_setting('archive_timeout'),"
            " current_setting('archive_command'), * from pg_stat_archiver;",
        )
        raise AssertionError(
            f"target {target}\n{backups.stdout}{backups.stderr}\n{stats}\n{logs.stdout[-6000:]}"
        ) from None
    future = await cluster.acli(
        "addons",
        "restore",
        "ledger",
        "--project",
        "shop",
        "--as",
        "x",
        "--to-time",
        str(time.time() + 3600),
        check=False,
    )
    assert future.returncode == 1 and "--to-time:" in future.stderr and "in the future" in future.stderr
    backups = await cluster.acli("addons", "backups", "ledger", "--project", "shop")
    assert "recoverable window" in backups.stderr
    restored = await cluster.acli(
        "addons", "restore", "ledger", "--project", "shop", "--as", "ledger-t", "--to-time", str(target)
    )
    assert "restoring shop/ledger-t" in restored.stderr, restored.stderr
    await eventually(lambda: _healthy(cluster, "ledger-t"), 240, "the fork healthy")
    await cluster.acli("addons", "detach", "ledger", "--env", WEB)
    await cluster.acli("addons", "attach", "ledger-t", "--env", WEB)
    await eventually(lambda: _answers(cluster, "select x from pitr order by x", ["a1", "a2"]), 120, "the fork's rows")
    assert await _rows(cluster, "select count(*) from entries") == ["100"]
    # the original is untouched: attach it back, every row there
    await cluster.acli("addons", "detach", "ledger-t", "--env", WEB)
    await cluster.acli("addons", "attach", "ledger", "--env", WEB)
    await eventually(
        lambda: _answers(cluster, "select x from pitr order by x", ["a1", "a2", "b1"]), 120, "the origin's rows"
    )


async def test_no_password_in_any_file_event_or_process_listing(cluster: E2ECluster) -> None:
    status, body = await cluster.get(HOST, "/url")
    assert status == 200
    password = body.split("postgresql://app:", 1)[1].split("@", 1)[0]
    assert len(password) == 32
    listing = (await asyncio.to_thread(subprocess.run, ["ps", "-eo", "args"], capture_output=True, text=True)).stdout
    assert password not in listing
    events = await cluster.acli("events", "--json", "--last", "500", check=False)
    assert password not in events.stdout + events.stderr
    leaks = []
    for path in cluster.root.rglob("*"):
        if not path.is_file() or "pgdata" in path.parts:  # the server's own files hold its SCRAM verifier only
            continue
        try:
            if password.encode() in path.read_bytes():
                leaks.append(str(path))
        except OSError:
            continue
    assert leaks == []


async def test_a_replica_restart_loses_no_committed_row(cluster: E2ECluster) -> None:
    await _rows(cluster, "insert into entries values ('before-restart')")
    info = await _info(cluster, "ledger")
    # the server process dies (SIGKILL: a crash); the agent starts the replica again on its volume
    # only this cluster's server: its data directory is under the cluster's root
    pids = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if (p.info["cmdline"] or [])[:2] == [f"{PG_BIN}/postgres", "-D"] and str(cluster.root) in p.info["cmdline"][2]
    ]
    assert pids, "no postgres process of this cluster"
    for process in pids:
        process.kill()
    await eventually(lambda: _answers(cluster, "select count(*) from entries", ["101"]), 180, "the rows after a crash")
    assert (await _info(cluster, "ledger"))["node_id"] == info["node_id"]
    # the operator's psql, carried over NATS to the server's socket on its node (no password anywhere)
    assert "101" in await _psql(cluster, "select count(*) from entries;")


async def test_archiving_goes_on_after_the_crash(cluster: E2ECluster) -> None:
    await _rows(cluster, "insert into entries values ('after-restart')")
    written = time.time()
    try:
        await eventually(lambda: _window_reaches(cluster, written), 90, "archiving after the crash")
    except AssertionError:
        raise AssertionError(await _archiver_diagnosis(cluster)) from None


async def _archiver_diagnosis(cluster: E2ECluster) -> str:
    out = ["PROCESSES"]
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline", "status", "create_time"]):
        line = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
        if any(w in line for w in ("postgres", "pgbackrest", "bwrap", "zattera-addon")):
            out.append(f"{p.info['pid']} {p.info['ppid']} {p.info['status']} {p.info['create_time']:.1f} {line[:200]}")
    out.append(
        await _psql(
            cluster,
            "select now(), pg_postmaster_start_time(), pg_current_wal_lsn(), pg_walfile_name(pg_current_wal_lsn()),"
            " current_setting('archive_timeout'), current_setting('archive_mode'), * from pg_stat_archiver;"
            " select pid, backend_type, wait_event_type, wait_event, state, backend_start from pg_stat_activity;",
        )
    )
    for path in sorted(cluster.root.rglob("pg_wal")):
        if "backup" in path.parts or "repo" in path.parts:
            continue
        out.append(f"WAL {path}")
        for f in sorted(path.rglob("*")):
            stat = f.stat()
            out.append(f"  {f.relative_to(path)} {stat.st_size} {stat.st_mtime:.1f}")
    for path in sorted(cluster.root.rglob("*.log")):
        if "log" in path.parent.name and "archive" in path.name:
            out += [f"LOG {path}", *path.read_text(errors="replace").splitlines()[-30:]]
    logs = await cluster.acli("logs", "--env", "shop/ledger/db", "-n", "400", check=False)
    out += ["SERVER LOG", *[ln for ln in logs.stdout.splitlines() if "zattera-addon-" not in ln][-80:]]
    return "\n".join(out)


async def _psql(cluster: E2ECluster, query: str) -> str:
    session = await asyncio.to_thread(
        subprocess.run,
        [*cli_argv(), "addons", "psql", "ledger", "--project", "shop"],
        input=query + "\n",
        env=cluster.cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert session.returncode == 0, session.stderr
    return session.stdout


async def _copied_off_site(cluster: E2ECluster, snapshot_id: str) -> bool:
    events = await cluster.acli("events", "--json", "--kind", "volume.offsite_copied", "--last", "50", check=False)
    return snapshot_id in events.stdout


async def test_a_fork_comes_back_from_off_site_when_the_nodes_backups_are_gone(cluster: E2ECluster, s3: str) -> None:
    """The whole path on the running cluster: `addons offsite` to an S3 server (moto), a snapshot of the
    backups volume copied there by the cluster's off-site loop, then the node's backups lost (the volume's
    files and every snapshot object in the cluster's store) and `addons restore --from` bringing a fork back
    with exactly the rows archived before the copy."""
    # ``s3``: moto's S3 server, the CLI's environment pointed at it as an operator's would be, the bucket made.
    url = f"s3://{BUCKET}/offsite"

    await _rows(cluster, "create table offsite(x text)")
    await _rows(cluster, "insert into offsite values ('kept')")
    written = time.time()
    await eventually(lambda: _window_reaches(cluster, written), 90, "the row archived")
    done = await cluster.acli("addons", "offsite", "ledger", url, "--project", "shop")
    assert f"copied to {url}" in done.stderr and SECRET_KEY not in done.stderr + done.stdout, done.stderr
    volume_id = str(cast(dict[str, str], (await _info(cluster, "ledger"))["volumes"])["backups"])
    taken = await cluster.acli("volumes", "snapshot", volume_id)
    snapshot_id = taken.stderr.split("snapshot ", 2)[-1].split(":", 1)[0].strip()
    assert ": complete" in taken.stderr and snapshot_id, taken.stderr
    await eventually(lambda: _copied_off_site(cluster, snapshot_id), 120, "the off-site copy")
    await _rows(cluster, "insert into offsite values ('after-the-copy')")

    # The node's backups are gone: the volume's files and every snapshot object of the cluster's store.
    [volume_dir] = [p for p in cluster.root.rglob(volume_id) if p.is_dir()]
    await asyncio.to_thread(shutil.rmtree, volume_dir)
    async with cluster.state() as (conn, _view):
        store = await SnapshotStore.open(conn.js)
        for obj in await store.list(""):
            await store.delete(obj.name)

    restored = await cluster.acli(
        "addons", "restore", "ledger", "--project", "shop", "--as", "ledger-o", "--from", url, "--latest"
    )
    assert "restoring shop/ledger-o" in restored.stderr, restored.stderr
    assert SECRET_KEY not in restored.stderr + restored.stdout
    await eventually(lambda: _healthy(cluster, "ledger-o"), 240, "the fork from off-site healthy")
    await cluster.acli("addons", "detach", "ledger", "--env", WEB)
    await cluster.acli("addons", "attach", "ledger-o", "--env", WEB)
    fork_rows = ["kept"]
    await eventually(lambda: _answers(cluster, "select x from offsite order by x", fork_rows), 120, "its rows")
    assert await _rows(cluster, "select count(*) from entries") != ["0"]
    events = await cluster.acli("events", "--json", "--last", "500", check=False)
    assert SECRET_KEY not in events.stdout + events.stderr, "an S3 setting in an event"
