"""A sandboxed instance has exited only when nothing of its sandbox is left: what its command left behind in
sessions of their own (a crashed PostgreSQL's backends, checkpointer, archiver: each calls setsid) is out
of reach of the group's SIGKILL, and must never overlap the instance's next start on the same volume
(docs/addons.md, "Archiving after a crash"). Real bubblewrap; the grace is shortened."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from services.agent import processes, sandbox
from services.agent.sandbox import Confinement, Sandbox, probe_now, sandbox_init
from services.agent.sandbox_users import UidTable
from tests.waiting import eventually


def _sandbox(root: Path) -> tuple[Sandbox, int]:
    if probe_now().problem:
        pytest.fail(f"no sandbox on this machine: {probe_now().problem}")
    agent = root / "agent"
    agent.mkdir(mode=0o700)
    uids = UidTable(agent / "sandbox", base=0x70000000, count=65536)
    return Sandbox(probe_now(), uids, hidden=(agent,)), uids.uid("leftovers")


async def test_wait_returns_once_the_sandbox_is_empty_and_kills_what_outlives_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "SANDBOX_EXIT_GRACE", 0.5)
    sandbox, uid = _sandbox(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, uid, uid)
    instance = tmp_path / "instance"
    instance.mkdir()
    marker = f"sleep {600 + os.getpid() % 3000}.5"  # one no other test runs
    # the command exits at once; a child of its own session stays (as a postmaster's children do)
    command = ["sh", "-c", f"setsid {marker} & sleep 0.3; exit 3"]
    handle = await processes.spawn(
        command,
        cwd=work,
        env={"PATH": "/usr/bin:/bin"},
        instance_dir=instance,
        sandbox=sandbox,
        confinement=Confinement(uid=uid, workdir=work, writable=(work,)),
    )
    assert handle.sandbox_left()

    def leftovers() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if " ".join(p.info["cmdline"] or []) == marker]

    await eventually(lambda: bool(leftovers()), 10, "the leftover started")
    started = time.monotonic()
    assert await handle.wait() == 3
    assert time.monotonic() - started < processes.SANDBOX_KILL_WAIT
    assert not handle.sandbox_left()
    assert leftovers() == []


def _namespace_pid(pid: int) -> int:
    """``pid`` as its own pid namespace numbers it (the last ``NSpid`` field)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid line for {pid}")


@pytest.mark.parametrize("kernel_list", [True, False], ids=["children-file", "psutil-scan"])
async def test_the_sandboxs_pid_1_is_found_from_the_kernels_list_or_else_psutils_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_list: bool
) -> None:
    # a kernel built without CONFIG_PROC_CHILDREN has no list of a thread's children
    monkeypatch.setattr(sandbox, "_kernel_lists_children", lambda: kernel_list)
    box, uid = _sandbox(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, uid, uid)
    instance = tmp_path / "instance"
    instance.mkdir()
    handle = await processes.spawn(
        ["sleep", "30"],
        cwd=work,
        env={"PATH": "/usr/bin:/bin"},
        instance_dir=instance,
        sandbox=box,
        confinement=Confinement(uid=uid, workdir=work, writable=(work,)),
    )
    try:
        init = sandbox_init(handle.pid, handle.create_time)
        assert init and _namespace_pid(init) == 1
        assert [child.pid for child in psutil.Process(handle.pid).children()] == [init]
        assert sandbox_init(handle.pid, handle.create_time - 1) == 0  # another process under that pid
    finally:
        handle.signal(signal.SIGKILL)
        await handle.wait()
    assert sandbox_init(handle.pid, handle.create_time) == 0  # gone
