"""A managed PostgreSQL instance started the way the node's agent starts it: the add-on's entry script
(shared/addons/postgres_entry.sh) with the variables of its release and its secrets in the environment,
as an unprivileged user (the sandbox's role; PostgreSQL refuses root), volumes in a temporary directory."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.addons import spec as addon
from shared.embedded import free_port

UID = 65534  # nobody: any unprivileged user will do
PG_BIN = addon.postgres_bin("15")


def require_servers() -> None:
    """Skip (a failure in CI) when PostgreSQL or pgBackRest is not installed."""
    missing = [p for p in (f"{PG_BIN}/postgres", shutil.which("pgbackrest") or "pgbackrest") if not Path(p).exists()]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (make install-system)")


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def own(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, UID)
    return path


@dataclass
class PgInstance:
    root: Path
    stanza: str
    superuser_password: str = field(default_factory=addon.new_password)
    app_password: str = field(default_factory=addon.new_password)
    extra: Mapping[str, str] = field(default_factory=dict)
    archive_timeout: int = 2
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def backups(self) -> Path:
        return self.root / "backups"

    @property
    def log(self) -> Path:
        return self.root / "instance.log"

    def env(self) -> dict[str, str]:
        spec = addon.service_spec(addon.POSTGRES, "15", self.stanza, archive_timeout=self.archive_timeout)
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **spec.vars,
            "ZATTERA_VOLUME_DATA": str(self.data),
            "ZATTERA_VOLUME_BACKUPS": str(self.backups),
            "HOST": "127.0.0.1",
            "PORT_POSTGRES": str(self.port),
            addon.SUPERUSER_PASSWORD: self.superuser_password,
            addon.APP_PASSWORD: self.app_password,
            **self.extra,
        }

    def start(self, timeout: float = 90.0, *, until: Callable[[], bool] | None = None) -> None:
        """Start and wait for ``until`` (default: the instance's ready file, after its first base backup)."""
        own(self.root)
        own(self.data)
        own(self.backups)
        if not self.port:
            self.port = free_port()
        env = self.env()
        script = self.root / "zattera-addon.sh"
        script.write_text(env.pop(addon.ENTRY_VAR))
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "sh", str(script)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )
        ready = until or (lambda: (self.data / "ready").exists())
        wait_for(lambda: ready() or self.process.poll() is not None, timeout, "ready")  # type: ignore[union-attr]
        if self.process.poll() is not None:
            raise AssertionError(f"the instance exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        code = self.process.returncode
        self.process = None
        return code

    def kill_server(self) -> None:
        """A crash: SIGKILL the postmaster itself (not the script), then stop what is left."""
        pid = int((self.data / "pgdata" / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(30)
        self.process = None
        # the postmaster's children exit once it is gone
        wait_for(lambda: not _any_process_of(self.data), 30, "the server's processes to exit")

    def accepts(self) -> bool:
        """The app role can log in over TCP (what a client sees as "up")."""
        try:
            return self.sql("select 1") == ["1"]
        except AssertionError:
            return False

    def sql(self, query: str, *, user: str = addon.APP_USER, db: str = addon.APP_DB) -> list[str]:
        password = self.superuser_password if user == "postgres" else self.app_password
        done = subprocess.run(
            [
                f"{PG_BIN}/psql",
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                user,
                "-d",
                db,
                "-Atc",
                query,
            ],
            env={"PGPASSWORD": password, "PATH": os.environ.get("PATH", "")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise AssertionError(f"psql: {done.stderr.strip()}")
        return [line for line in done.stdout.splitlines() if line]

    def archived_through_current(self) -> None:
        """Force the current WAL segment out and wait until it is in the repository."""
        wal = self.sql("select pg_walfile_name(pg_switch_wal())", user="postgres")[0]
        archived = "select coalesce(last_archived_wal, '') from pg_stat_archiver"
        wait_for(
            lambda: self.sql(archived, user="postgres")[0] >= wal,
            60,
            f"WAL {wal} archived",
        )


def _any_process_of(data: Path) -> bool:
    needle = str(data)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle.encode() in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False
