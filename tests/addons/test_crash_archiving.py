"""Archiving goes on after a crash, the instance started as the node's agent starts it (its sandbox: real
bubblewrap, ``processes.spawn``): the postmaster is SIGKILLed, the instance restarted on its volumes, a write
made, and the segment holding it must reach the repository within seconds (``archive_timeout`` 2 s) — each
time. Before the entry script woke the checkpointer, 5 of 8 such restarts stalled until checkpoint_timeout
(docs/addons.md, "Archiving after a crash"). Run through the slot (real servers)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from services.agent import processes
from services.agent.sandbox import Confinement, Sandbox, probe_now
from services.agent.sandbox_users import UidTable
from shared.addons import spec as addon
from shared.embedded import free_port
from tests.addons.pgserver import PG_BIN, PgInstance, require_servers
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(300)

RESTARTS = 4


def _newest_archived(pg: PgInstance) -> float:
    files = (pg.backups / "repo" / "archive" / pg.stanza).rglob("0*")
    return max((f.stat().st_mtime for f in files), default=0.0)


async def test_each_restart_after_a_crash_archives_within_seconds(tmp_path: Path) -> None:
    require_servers()
    if probe_now().problem:
        pytest.fail(f"no sandbox on this machine: {probe_now().problem}")
    agent = tmp_path / "agent"
    agent.mkdir(mode=0o700)
    uids = UidTable(agent / "sandbox", base=0x70000000, count=65536)
    sandbox, uid = Sandbox(probe_now(), uids, hidden=(agent,)), uids.uid("orders")
    pg = PgInstance(tmp_path / "db", "orders", extra={"ZATTERA_PG_REPORT_INTERVAL": "2"})
    for directory in (pg.root, pg.data, pg.backups):
        directory.mkdir(parents=True, exist_ok=True)
        os.chown(directory, uid, uid)
    confinement = Confinement(uid=uid, workdir=pg.root, writable=(pg.root,))
    instance_dir = tmp_path / "instance"
    instance_dir.mkdir()
    stalls = []
    for start in range(RESTARTS + 1):
        pg.port = free_port()  # as the agent does: a new port at each start
        env = pg.env()
        (pg.root / "zattera-addon.sh").write_text(env.pop(addon.ENTRY_VAR))
        handle = await processes.spawn(
            ["sh", "zattera-addon.sh"],
            cwd=pg.root,
            env=env,
            instance_dir=instance_dir,
            sandbox=sandbox,
            confinement=confinement,
        )
        await eventually(lambda: (pg.data / "ready").exists(), 120, "the instance ready")
        pg.sql("create table if not exists t(x int)")
        written = float(pg.sql("select extract(epoch from now())")[0])
        pg.sql("insert into t select generate_series(1, 1000)")
        assert pg.sql("select count(*) from t") == [str(1000 * (start + 1))]  # no committed row lost
        try:
            await eventually(lambda at=written: _newest_archived(pg) >= at, 20, "the write archived")
        except AssertionError:
            stalls.append(start)
        # A child the postmaster has just forked shows the same command line until it sets its own process
        # title: the postmaster is the one whose parent is not one of them.
        same = {
            p.pid: p
            for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[:3] == [f"{PG_BIN}/postgres", "-D", str(pg.data / "pgdata")]
        }
        postmaster = [p for p in same.values() if p.ppid() not in same]
        assert len(postmaster) == 1, same
        postmaster[0].kill()  # a crash
        await handle.wait()  # the instance has exited once nothing of its sandbox is left
        assert not handle.sandbox_left()
        handle.kill_leftovers()
    assert stalls == [], f"archiving stalled after starts {stalls}"
