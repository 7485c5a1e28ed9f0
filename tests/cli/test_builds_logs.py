"""``zattera builds logs <id> [--follow]`` against a real NATS server: the log lines and the end marker are
stored the way the build dispatcher stores them (shared/buildlogs.py)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from typer.testing import CliRunner
from zattera.v1 import types_pb2 as pb

from cli.main import app
from shared.buildlogs import append_log_lines, close_log
from shared.connection import Connection, connect
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
READ_TIMEOUT = 30.0  # a fresh interpreter imports the CLI first


def running_build(build_id: str) -> pb.Build:
    b = pb.Build(app_id="app1", project_id="proj1", environment_id="env1", status=pb.BUILD_STATUS_RUNNING)
    b.meta.id = build_id
    b.node_id = "builder-a"
    return b


async def seed_running(conn: Connection, build_id: str) -> None:
    view = StateView(conn, name="seed")
    await view.start()
    try:
        writer = Writer(conn, view)
        await writer.commit(writer.txn("seed").put(running_build(build_id)))
    finally:
        await view.stop()


def with_conn(nats_url: str, fn: Callable[[Connection], Awaitable[T]]) -> T:
    """Run ``fn`` on a connection of its own (the CLI under CliRunner runs its own event loop)."""

    async def go() -> T:
        conn = await connect(nats_url, name="test-seed")
        try:
            await provision(conn.js)
            return await fn(conn)
        finally:
            await conn.close()

    return asyncio.run(go())


def zattera_command() -> list[str]:
    script = Path(sys.executable).with_name("zattera")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from cli.main import main; sys.argv[0] = 'zattera'; main()"]


async def store_lines(conn: Connection, build_id: str, lines: Sequence[str], first_seq: int = 1) -> None:
    await append_log_lines(conn, build_id, [(first_seq + i, line) for i, line in enumerate(lines)])


def test_logs_and_follow_of_an_ended_build_print_every_line_and_exit_0(nats_url: str) -> None:
    async def seed(conn: Connection) -> None:
        await seed_running(conn, "b1")
        await store_lines(conn, "b1", ["step 1/2", "step 2/2", "done: sha256:abc123"])
        await close_log(conn, "b1", pb.BUILD_STATUS_SUCCEEDED)

    with_conn(nats_url, seed)
    runner = CliRunner()
    expected = "step 1/2\nstep 2/2\ndone: sha256:abc123\n"

    read = runner.invoke(app, ["--nats", nats_url, "builds", "logs", "b1"], catch_exceptions=False)
    assert read.exit_code == 0, read.output
    assert read.stdout == expected

    # The record still says RUNNING: only the end marker can end this follow (no idle-check exit).
    followed = runner.invoke(app, ["--nats", nats_url, "builds", "logs", "b1", "--follow"], catch_exceptions=False)
    assert followed.exit_code == 0, followed.output
    assert followed.stdout == expected


async def test_follow_prints_lines_as_they_are_stored_and_exits_0_at_the_end_marker(
    nats_url: str, conn: Connection
) -> None:
    await seed_running(conn, "b1")
    await store_lines(conn, "b1", ["step 1/3", "step 2/3"])
    proc = await asyncio.create_subprocess_exec(
        *zattera_command(),
        "--nats",
        nats_url,
        "builds",
        "logs",
        "b1",
        "--follow",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
    )
    assert proc.stdout is not None
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), READ_TIMEOUT) == b"step 1/3\n"
        assert await asyncio.wait_for(proc.stdout.readline(), READ_TIMEOUT) == b"step 2/3\n"
        assert proc.returncode is None  # still following

        await store_lines(conn, "b1", ["step 3/3"], first_seq=3)
        assert await asyncio.wait_for(proc.stdout.readline(), READ_TIMEOUT) == b"step 3/3\n"
        assert proc.returncode is None

        await close_log(conn, "b1", pb.BUILD_STATUS_SUCCEEDED)
        rest, errors = await asyncio.wait_for(proc.communicate(), READ_TIMEOUT)
        assert proc.returncode == 0, errors.decode()
        assert rest == b""  # the end marker is not printed
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
