"""The managed PostgreSQL instance on the real server and pgBackRest, started as the agent starts it:
committed rows survive a clean restart and a crash; point-in-time recovery as a fork gives exactly the
rows committed before the target and never touches the origin; no password in a process listing or a
log file."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shared.addons.backups import status_from_lines
from tests.addons.pgserver import PgInstance, require_servers, wait_for


@pytest.fixture
def root() -> Iterator[Path]:
    """A directory the database's user can traverse (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="zattera-addons-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def instances() -> Iterator[list[PgInstance]]:
    require_servers()
    started: list[PgInstance] = []
    yield started
    for instance in started:
        instance.stop()


def _new(instances: list[PgInstance], root: Path, stanza: str, **extra: str) -> PgInstance:
    instance = PgInstance(root, stanza, extra=extra)
    instances.append(instance)
    instance.start()
    return instance


def test_committed_rows_survive_a_restart_and_a_crash(instances: list[PgInstance], root: Path) -> None:
    db = _new(instances, root / "db", "orders")
    db.sql("create table t(x int primary key)")
    db.sql("insert into t select generate_series(1, 500)")
    db.stop()  # a replica restart (the agent's SIGTERM: a fast shutdown)
    db.start()
    assert db.sql("select count(*) from t") == ["500"]
    db.sql("insert into t values (501)")  # committed, then the server crashes
    db.kill_server()
    db.start()
    assert db.sql("select count(*), max(x) from t") == ["501|501"]


def test_point_in_time_fork_gives_exactly_the_rows_before_the_target(instances: list[PgInstance], root: Path) -> None:
    origin = _new(instances, root / "origin", "origin", ZATTERA_PG_REPORT_INTERVAL="1")
    origin.sql("create table t(x text)")
    origin.sql("insert into t values ('a1'), ('a2')")
    time.sleep(1.1)  # commit timestamps have microseconds; T falls strictly between A and B
    target = origin.sql("select to_char(now() at time zone 'utc', 'YYYY-MM-DD HH24:MI:SS.US') || '+00'")[0]
    time.sleep(1.1)
    origin.sql("insert into t values ('b1')")
    origin.archived_through_current()
    repo = origin.backups / "repo"
    # what `zattera addons backups` reads: the instance's report in its log
    report = status_from_lines((0.0, line) for line in origin.log.read_text().splitlines())
    assert report is not None and [b.type for b in report.backups] == ["full"] and report.window_start > 0
    # ...and the archive's end passes the target once the segment holding it is archived
    target_epoch = datetime.strptime(target, "%Y-%m-%d %H:%M:%S.%f+00").replace(tzinfo=UTC).timestamp()

    def window_end() -> float:
        status = status_from_lines((0.0, line) for line in origin.log.read_text().splitlines())
        return status.window_end if status is not None else 0.0

    wait_for(lambda: window_end() > target_epoch, 30, "the reported window to pass the target")
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())

    fork = _new(
        instances,
        root / "fork",
        "fork",
        ZATTERA_PG_RESTORE_REPO=str(repo),
        ZATTERA_PG_RESTORE_STANZA="origin",
        ZATTERA_PG_RESTORE_TARGET=target,
    )
    assert fork.sql("select x from t order by x") == ["a1", "a2"]
    # the fork has its own passwords and its own repository, with a base backup of its own
    assert (fork.backups / "repo" / "backup" / "fork" / "backup.info").exists()
    fork.sql("insert into t values ('fork-only')")
    # the origin is untouched: its rows, and its repository gained no file from the fork's restore
    assert origin.sql("select x from t order by x") == ["a1", "a2", "b1"]
    assert not any("fork" in name for name in before)
    assert not (repo / "backup" / "fork").exists()

    latest = _new(
        instances,
        root / "latest",
        "latest",
        ZATTERA_PG_RESTORE_REPO=str(repo),
        ZATTERA_PG_RESTORE_STANZA="origin",
        ZATTERA_PG_RESTORE_TARGET="latest",
    )
    assert latest.sql("select x from t order by x") == ["a1", "a2", "b1"]


def test_no_password_in_a_process_listing_or_a_log(instances: list[PgInstance], root: Path) -> None:
    db = _new(instances, root / "db", "quiet")
    db.sql("select 1")
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in (".log", "")]
    texts = [listing] + [p.read_bytes().decode(errors="replace") for p in files if "pgdata" not in p.parts]
    for secret in (db.superuser_password, db.app_password):
        assert not any(secret in text for text in texts)
    # and the server's own log directory, if any, too
    assert all(db.app_password not in p.read_bytes().decode(errors="replace") for p in (db.backups / "log").iterdir())
