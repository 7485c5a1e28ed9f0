"""Instance logs end to end: real NATS, real agent, real app processes writing stdout and stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent import logs
from services.agent.logs import CURSOR_FILE, STREAM_FILES, InstanceLogShipper, ShipperSettings, split_lines
from services.orchestrator.model import GREEN_FAILED_TO_START, failed_instance_reason
from shared.applogs import STDERR, STDOUT, AppLogLine, LogLimits, app_logs_stream_config, read_app_logs
from shared.connection import Connection
from shared.files import write_atomic
from shared.provisioning import create_or_update_stream
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, process_ref, release
from tests.agent.test_runtime import seed, state_of
from tests.waiting import eventually

ENV = "E1"

WRITER = """
import itertools, sys, time
count = int(sys.argv[1])
pause = float(sys.argv[2])
for i in (itertools.count() if count < 0 else range(count)):
    print(f"out {i}", flush=True)
    if i % 10 == 0:
        print(f"err {i}", file=sys.stderr, flush=True)
    if pause:
        time.sleep(pause)
time.sleep(3600)
"""


def writer_ref(directory: Path, count: int, pause: float = 0.0) -> str:
    (directory / "writer.py").write_text(WRITER)
    return process_ref(directory, f"{sys.executable} writer.py {count} {pause}")


async def env_stream(conn: Connection) -> None:
    await create_or_update_stream(conn.js, app_logs_stream_config(ENV, LogLimits(64 * 1024 * 1024, 3600.0), 1))


async def read(conn: Connection, *, last: int = 1_000_000, instance: str = "") -> list[AppLogLine]:
    return [line async for line in read_app_logs(conn, ENV, last=last, instance=instance, idle=0.5)]


@pytest.mark.parametrize(
    ("data", "final", "lines", "used"),
    [
        (b"a\nb\npa", False, [b"a", b"b"], 4),
        (b"a\nb\nend", True, [b"a", b"b", b"end"], 7),
        (b"\n" * 10, False, [b""] * 3, 3),  # at most max_lines
        (b"x" * 10 + b"\nyy", False, [b"xxxx", b"xxxx", b"xx"], 11),  # a long line is cut
        (b"y" * 5, False, [b"yyyy", b"y"], 5),  # an unterminated one too, once longer than max_line
        (b"", True, [], 0),
    ],
)
def test_split_lines(data: bytes, final: bool, lines: list[bytes], used: int) -> None:
    assert split_lines(data, final=final, max_line=4, max_lines=3) == (lines, used)


async def test_stdout_and_stderr_are_tagged_and_kept_in_order(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await env_stream(conn)
    await start_agent("n1")
    rel = release(writer_ref(tmp_path, 500), healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    async def all_shipped() -> bool:
        return len(await read(conn)) == 550

    await eventually(all_shipped, what="500 stdout and 50 stderr lines in the stream")
    lines = await read(conn)
    assert {(line.instance, line.node, line.release) for line in lines} == {(a.meta.id, "n1", rel.meta.id)}
    assert [line.line for line in lines if line.stream == STDOUT] == [f"out {i}" for i in range(500)]
    assert [line.line for line in lines if line.stream == STDERR] == [f"err {i}" for i in range(0, 500, 10)]
    times = [line.time_ns for line in lines]
    assert times == sorted(times)


async def test_backfill_takes_the_newest_n_across_two_replicas_in_time_order(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await env_stream(conn)
    await start_agent("n1")
    rel = release(writer_ref(tmp_path, 200, 0.001), healthcheck=False)
    first, second = assignment("n1", rel), assignment("n1", rel)
    await seed(writer, rel, first, second)

    async def all_shipped() -> bool:
        return len(await read(conn)) == 2 * 220

    await eventually(all_shipped, what="both replicas' lines in the stream")
    everything = await read(conn)
    newest = await read(conn, last=30)
    assert len(newest) == 30
    assert [line.time_ns for line in newest] == sorted(line.time_ns for line in everything)[-30:]
    a_few_more_than_stored = await read(conn, last=2 * 220 + 3)  # was: the newest 3 only (a negative index)
    assert a_few_more_than_stored == sorted(everything, key=lambda line: line.time_ns)
    only_first = await read(conn, last=5, instance=first.meta.id)
    assert {line.instance for line in only_first} == {first.meta.id} and len(only_first) == 5
    assert {line.instance for line in everything} == {first.meta.id, second.meta.id}


async def test_agent_restart_loses_no_line_and_adopted_output_continues(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await env_stream(conn)
    data_dir = tmp_path / "agent-n1"
    first = await start_agent("n1", data_dir=data_dir, stop_on_exit=False)
    rel = release(writer_ref(tmp_path, -1, 0.002), healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    async def shipped_at_least(n: int) -> bool:
        return len([line for line in await read(conn) if line.stream == STDOUT]) >= n

    await eventually(lambda: shipped_at_least(100), what="lines shipped before the restart")
    await first.stop()
    stdout_file = data_dir / "instances" / a.meta.id / STREAM_FILES[STDOUT]
    written_while_down = stdout_file.read_bytes().count(b"\n")
    await eventually(
        lambda: stdout_file.read_bytes().count(b"\n") > written_while_down + 50, what="the app writes on, unshipped"
    )
    written_before_restart = stdout_file.read_bytes().count(b"\n")

    second = await start_agent("n1", data_dir=data_dir)
    await eventually(lambda: a.meta.id in second.agent.runtime.running(), what="the process adopted")  # type: ignore[union-attr]
    await eventually(lambda: shipped_at_least(written_before_restart + 100), what="adopted output shipped")
    numbers = [int(line.line.split()[1]) for line in await read(conn) if line.stream == STDOUT]
    distinct = sorted(set(numbers))
    assert distinct == list(range(len(distinct)))  # no gap: nothing written before the restart is lost
    assert len(distinct) >= written_before_restart + 100


async def test_crash_reports_exit_code_and_last_stderr_lines(
    start_agent: StartAgent, conn: Connection, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    await env_stream(conn)
    await start_agent("n1")
    command = "echo starting; echo 'fatal: DATABASE_URL not set' >&2; exit 3"
    rel = release("exec:" + quote(command, safe=""), healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    await eventually(lambda: state_of(view, "n1", a.meta.id) == pb.INSTANCE_STATE_FAILED, what="FAILED")
    observed = view.observed("n1", a.meta.id)
    assert observed is not None
    assert observed.last_exit.code_known and observed.last_exit.code == 3
    assert observed.last_exit.stderr_tail[-1] == "fatal: DATABASE_URL not set"
    assert "exit code 3" in observed.message
    kept = tmp_path / "agent-n1" / "instances" / a.meta.id / STREAM_FILES[STDERR]
    assert b"fatal: DATABASE_URL not set" in kept.read_bytes()  # the directory stays while the assignment does
    lines = await read(conn)
    assert [line.line for line in lines if line.stream == STDERR] == ["fatal: DATABASE_URL not set"] * 3
    # What the orchestrator makes of this report when the instance is green.
    reported = view.assignment(a.meta.id)
    assert reported is not None
    assert failed_instance_reason(GREEN_FAILED_TO_START, [reported]) == (
        f"a green instance failed to start: instance {a.meta.id} on n1: exit code 3; "
        "last stderr: fatal: DATABASE_URL not set"
    )


async def test_a_flood_beyond_the_backlog_bound_is_dropped_and_counted(conn: Connection, tmp_path: Path) -> None:
    await env_stream(conn)
    total = 200_000
    (tmp_path / STREAM_FILES[STDOUT]).write_bytes(b"".join(b"flood line %06d\n" % i for i in range(total)))
    shipper = InstanceLogShipper(
        conn,
        tmp_path,
        environment_id=ENV,
        instance_id="I1",
        node_id="n1",
        settings=ShipperSettings(max_backlog=256 * 1024, batch_bytes=64 * 1024),
    )
    while await shipper.pump(final=False):
        pass

    lines = await read(conn)
    notices = [line for line in lines if line.dropped]
    assert len(notices) == 1 and notices[0].line == f"{notices[0].dropped} lines dropped"
    shipped = [line.line for line in lines if not line.dropped]
    assert notices[0].dropped + len(shipped) == total
    assert shipped[-1] == f"flood line {total - 1:06d}"  # the newest lines are the ones kept
    assert shipper.dropped_total == notices[0].dropped


async def test_shipped_files_are_emptied_before_the_next_start_and_shipping_goes_on(
    conn: Connection, tmp_path: Path
) -> None:
    await env_stream(conn)
    shipper = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
    )
    out = tmp_path / STREAM_FILES[STDOUT]
    out.write_bytes(b"first run\n")
    assert await shipper.pump(final=False)
    shipper.process_starting()
    assert out.stat().st_size == 0
    out.write_bytes(b"second run\n")  # offset 0 again: a new generation, so not taken for a duplicate
    assert await shipper.pump(final=False)
    assert [line.line for line in await read(conn)] == ["first run", "second run"]

    resumed = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
    )
    with out.open("ab") as sink:
        sink.write(b"after an agent restart\n")
    assert await resumed.pump(final=False)
    assert not await resumed.pump(final=False)
    assert [line.line for line in await read(conn)][-1] == "after an agent restart"
    assert len(await read(conn)) == 3


async def test_the_cursor_is_written_only_when_it_changes(
    conn: Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start in a fresh directory writes no cursor (nothing to empty, nothing shipped); a restart
    after everything was shipped writes the new generation once, before the files are emptied; each shipped
    batch writes it. What a restarted agent reads is what it would have read with every write made."""
    await env_stream(conn)
    written: list[dict[str, object]] = []

    def counting(path: Path, data: str, **kwargs: Any) -> Path:
        written.append(json.loads(data))
        return write_atomic(path, data, **kwargs)

    monkeypatch.setattr(logs, "write_atomic", counting)
    directory = tmp_path / "instance"
    directory.mkdir()

    def shipper() -> InstanceLogShipper:
        return InstanceLogShipper(
            conn, directory, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
        )

    first = shipper()
    first.process_starting()
    assert written == [] and not (directory / CURSOR_FILE).exists()
    out, err = (directory / STREAM_FILES[stream] for stream in (STDOUT, STDERR))
    out.write_bytes(b"first run\n")
    err.write_bytes(b"")
    assert await first.pump(final=False)
    assert written == [{"generation": 0, "offsets": {STDOUT: 10, STDERR: 0}, "stderr_run_start": 0}]
    assert not await first.pump(final=False)
    assert len(written) == 1

    first.process_starting()  # everything shipped: a new generation, the files emptied, stderr starts at 0
    assert written[1:] == [{"generation": 1, "offsets": {STDOUT: 0, STDERR: 0}, "stderr_run_start": 0}]
    assert out.stat().st_size == 0
    out.write_bytes(b"second run\n")
    err.write_bytes(b"oops\n")
    first.process_starting()  # not shipped yet: kept, and the stderr tail of this run starts after "oops"
    assert written[2:] == [{"generation": 1, "offsets": {STDOUT: 0, STDERR: 0}, "stderr_run_start": 5}]
    first.process_starting()  # nothing changed: nothing written
    assert len(written) == 3

    resumed = shipper()  # an agent restart: from the file
    resumed.process_starting()
    assert len(written) == 3
    while await resumed.pump(final=False):
        pass
    assert [line.line for line in await read(conn)] == ["first run", "second run", "oops"]


async def test_a_batch_stored_before_the_cursor_was_saved_does_not_hide_the_lines_read_after_it(
    conn: Connection, tmp_path: Path
) -> None:
    """The agent dies after the stream stored a batch and before it saved the cursor. The next run reads
    again from the old cursor, and further (the app wrote on): that longer batch is new to the stream, not
    a duplicate of the first (it once was, by message id, and its extra lines were lost)."""
    await env_stream(conn)
    out = tmp_path / STREAM_FILES[STDOUT]
    out.write_bytes(b"".join(b"line %d\n" % i for i in range(10)))
    first = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
    )
    assert await first.pump(final=False)
    (tmp_path / CURSOR_FILE).unlink()  # the crash came before the cursor reached the disk
    with out.open("ab") as sink:
        sink.write(b"".join(b"line %d\n" % i for i in range(10, 20)))

    resumed = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
    )
    while await resumed.pump(final=False):
        pass
    shipped = [line.line for line in await read(conn)]
    assert sorted(set(shipped), key=lambda line: int(line.split()[1])) == [f"line {i}" for i in range(20)]

    assert not await resumed.pump(final=False)
    (tmp_path / CURSOR_FILE).unlink()
    again = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
    )
    assert await again.pump(final=False)  # the very same bytes again: the stream keeps one copy
    assert len(await read(conn)) == len(shipped)


async def test_what_one_read_finds_on_both_streams_reads_stdout_first(conn: Connection, tmp_path: Path) -> None:
    """A crash: buffered stdout and the error on stderr land in the files together. The reader's time order
    puts the error last, as a terminal would (stderr used to come first, before the lines that led to it)."""
    await env_stream(conn)
    (tmp_path / STREAM_FILES[STDOUT]).write_bytes(b"starting\nconnecting to the database\n")
    (tmp_path / STREAM_FILES[STDERR]).write_bytes(b"fatal: DATABASE_URL not set\n")
    shipper = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings()
    )
    assert await shipper.pump(final=True)
    lines = await read(conn)
    assert [(line.stream, line.line) for line in lines] == [
        (STDOUT, "starting"),
        (STDOUT, "connecting to the database"),
        (STDERR, "fatal: DATABASE_URL not set"),
    ]
    assert lines[0].time_ns < lines[2].time_ns


@pytest.mark.parametrize("written", [1, 15, 20, 35])
async def test_the_stderr_tail_holds_the_last_lines_up_to_its_length(
    conn: Connection, tmp_path: Path, written: int
) -> None:
    (tmp_path / STREAM_FILES[STDERR]).write_bytes(b"".join(b"error %d\n" % i for i in range(written)))
    shipper = InstanceLogShipper(
        conn, tmp_path, environment_id=ENV, instance_id="I1", node_id="n1", settings=ShipperSettings(stderr_tail=20)
    )
    assert shipper.stderr_tail() == [f"error {i}" for i in range(max(0, written - 20), written)]  # 15: was 5
