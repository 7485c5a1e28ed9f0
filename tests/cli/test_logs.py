"""``zattera logs`` and ``zattera builds logs --json`` against a real NATS server; the log lines are stored the
way the agent stores them (InstanceLogBatch on zattera.logs.<env>.<instance>)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from typer.testing import CliRunner
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.main import app
from shared.applogs import LogLimits, app_log_subject, app_logs_stream_config
from shared.buildlogs import close_log
from shared.connection import Connection
from shared.provisioning import create_or_update_stream
from shared.txn import Writer
from tests.cli.test_builds_logs import READ_TIMEOUT, REPO_ROOT, seed_running, store_lines, with_conn, zattera_command
from tests.factories import env

BASE_NS = 1_800_000_000 * 10**9


async def publish(conn: Connection, instance: str, *lines: tuple[int, str, str]) -> None:
    """(time offset in ms, stream, text) lines of one instance, as one batch."""
    batch = cpb.InstanceLogBatch(environment_id="E1", instance_id=instance, node_id="n1", release_id="R1")
    for offset_ms, stream, text in lines:
        stamp = Timestamp()
        stamp.FromNanoseconds(BASE_NS + offset_ms * 1_000_000)
        batch.lines.add(time=stamp, stream=stream, line=text)
    await conn.js.publish(app_log_subject("E1", instance), batch.SerializeToString())


async def seed_env(conn: Connection) -> None:
    from shared.state.feed import StateView

    view = StateView(conn, name="seed")
    await view.start()
    try:
        writer = Writer(conn, view)
        await writer.commit(writer.txn("seed").put(env("E1")))
    finally:
        await view.stop()
    await create_or_update_stream(conn.js, app_logs_stream_config("E1", LogLimits(1 << 24, 3600.0), 1))


def test_backfill_merges_replicas_in_time_order_with_json_and_instance_filter(nats_url: str) -> None:
    async def seed(conn: Connection) -> None:
        await seed_env(conn)
        await publish(conn, "I1", (0, "stdout", "a0"), (20, "stderr", "a2"), (40, "stdout", "a4"))
        await publish(conn, "I2", (10, "stdout", "b1"), (30, "stdout", "b3"))

    with_conn(nats_url, seed)
    runner = CliRunner()
    result = runner.invoke(app, ["--nats", nats_url, "logs", "--env", "E1", "-n", "3", "--json"])
    assert result.exit_code == 0, result.output
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [d["line"] for d in docs] == ["a2", "b3", "a4"]
    assert docs[0] == {
        "time": (BASE_NS + 20_000_000) / 1e9,
        "stream": "stderr",
        "line": "a2",
        "instance": "I1",
        "node": "n1",
        "release": "R1",
    }

    text = runner.invoke(app, ["--nats", nats_url, "logs", "--env", "E1", "--instance", "I2"])
    assert text.exit_code == 0, text.output
    assert text.stdout.splitlines() == [
        "2027-01-15T08:00:00.010Z I2 out b1",
        "2027-01-15T08:00:00.030Z I2 out b3",
    ]


async def test_follow_prints_the_backfill_then_new_lines(nats_url: str, conn: Connection) -> None:
    await seed_env(conn)
    await publish(conn, "I1", (0, "stdout", "old"))
    proc = await asyncio.create_subprocess_exec(
        *zattera_command(),
        "--nats",
        nats_url,
        "logs",
        "--env",
        "E1",
        "-f",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
    )
    assert proc.stdout is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), READ_TIMEOUT)
        assert json.loads(first)["line"] == "old"
        await publish(conn, "I2", (5, "stderr", "new"))
        second = json.loads(await asyncio.wait_for(proc.stdout.readline(), READ_TIMEOUT))
        assert (second["line"], second["instance"], second["stream"]) == ("new", "I2", "stderr")
        assert proc.returncode is None
    finally:
        proc.kill()
        await proc.wait()


def test_bad_input_gets_one_clear_line(nats_url: str) -> None:
    with_conn(nats_url, seed_env)
    runner = CliRunner()
    cases = {
        ("-n", "-1"): "error: -n/--lines: must be 0 or more, got -1",
        ("--since", "nonsense"): "error: --since 'nonsense': 'nonsense' is not a duration",
        ("--instance", "a.b"): "error: --instance:",
    }
    for extra, message in cases.items():
        result = runner.invoke(app, ["--nats", nats_url, "logs", "--env", "E1", *extra])
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(message), result.stderr
        assert "Traceback" not in result.output
    unknown = runner.invoke(app, ["--nats", nats_url, "logs", "--env", "demo/none/prod"])
    assert unknown.exit_code == 1
    assert unknown.stderr.strip() == "error: --env: no environment 'demo/none/prod' (use an id or project/app/env)"


def test_builds_logs_json_prints_one_object_per_line(nats_url: str) -> None:
    async def seed(conn: Connection) -> None:
        await seed_running(conn, "b1")
        await store_lines(conn, "b1", ["step 1/2", "step 2/2"])
        await close_log(conn, "b1", pb.BUILD_STATUS_SUCCEEDED)

    with_conn(nats_url, seed)
    result = CliRunner().invoke(app, ["--nats", nats_url, "builds", "logs", "b1", "--json"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line) for line in result.stdout.splitlines()] == [
        {"build_id": "b1", "line": "step 1/2"},
        {"build_id": "b1", "line": "step 2/2"},
    ]


def test_ps_shows_restarts_and_the_last_exit(nats_url: str) -> None:
    async def seed(conn: Connection) -> None:
        from shared import keys as K
        from shared.state.feed import StateView

        view = StateView(conn, name="seed")
        await view.start()
        try:
            writer = Writer(conn, view)
            a = pb.Assignment(node_id="n1", environment_id="E1", release_id="R1", desired=pb.ASSIGNMENT_DESIRED_RUN)
            a.meta.id = "A1"
            observed = pb.AssignmentObserved(state=pb.INSTANCE_STATE_STARTING, restarts=2)
            observed.last_exit.signal = 9
            observed.last_exit.oom_suspected = True
            await writer.commit(writer.txn().create(a).put(observed, key=K.observed("n1", "A1")))
        finally:
            await view.stop()

    with_conn(nats_url, seed)
    result = CliRunner().invoke(app, ["--nats", nats_url, "ps", "--wide"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "A1" in line)
    assert "│ 2 " in row and "killed by SIGKILL (likely out of memory)" in row


def test_since_keeps_only_the_newer_lines(nats_url: str) -> None:
    import time

    now_ms = int(time.time() * 1000) - BASE_NS // 1_000_000

    async def seed(conn: Connection) -> None:
        await seed_env(conn)
        await publish(conn, "I1", (now_ms - 3_600_000, "stdout", "an hour ago"), (now_ms - 1000, "stdout", "just now"))

    with_conn(nats_url, seed)
    result = CliRunner().invoke(app, ["--nats", nats_url, "logs", "--env", "E1", "--since", "10m", "--json"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["line"] for line in result.stdout.splitlines()] == ["just now"]


def test_apply_writes_the_env_log_retention(nats_url: str, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(
        'project = "demo"\napp = "hello"\n[env.production]\n[env.production.logs]\n'
        'max_bytes = "64MiB"\nmax_age = "72h"\n'
    )
    runner = CliRunner()
    assert runner.invoke(app, ["--nats", nats_url, "cluster", "init"]).exit_code == 0
    applied = runner.invoke(app, ["--nats", nats_url, "apps", "apply", str(spec)])
    assert applied.exit_code == 0, applied.output

    async def stored(conn: Connection) -> pb.Environment:
        from shared.actions.names import resolve_env
        from shared.state.feed import StateView

        view = StateView(conn, name="check")
        await view.start()
        try:
            env_ = resolve_env(view, "demo/hello/production")
            assert env_ is not None
            return env_
        finally:
            await view.stop()

    env_ = with_conn(nats_url, stored)
    assert env_.logs.max_bytes == 64 * 1024 * 1024 and env_.logs.max_age.seconds == 72 * 3600

    spec.write_text('project = "demo"\napp = "hello"\n[env.production.logs]\nmax_bytes = "10KB"\n')
    refused = runner.invoke(app, ["--nats", nats_url, "apps", "apply", str(spec)])
    assert refused.exit_code != 0
    assert "env.production.logs.max_bytes" in refused.output and "below the 1MiB minimum" in refused.output


def test_an_env_without_logs_yet_says_so(nats_url: str) -> None:
    async def seed(conn: Connection) -> None:
        from shared.state.feed import StateView

        view = StateView(conn, name="seed")
        await view.start()
        try:
            await Writer(conn, view).commit(Writer(conn, view).txn().put(env("E9")))
        finally:
            await view.stop()

    with_conn(nats_url, seed)
    result = CliRunner().invoke(app, ["--nats", nats_url, "logs", "--env", "E9"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr.strip() == "no logs for E9 yet"


async def test_follow_into_a_closed_pipe_ends_quietly(nats_url: str, conn: Connection) -> None:
    await seed_env(conn)
    await publish(conn, "I1", (0, "stdout", "line 0"))
    shell = f"{' '.join(zattera_command())} --nats {nats_url} logs --env E1 -f | head -1"
    proc = await asyncio.create_subprocess_shell(
        shell,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
    )
    ended = asyncio.ensure_future(proc.communicate())
    n = 0
    while not ended.done() and n < 300:  # keep lines coming until the follower has written into the closed pipe
        n += 1
        await publish(conn, "I1", (n, "stdout", f"line {n}"))
        await asyncio.wait([ended], timeout=0.1)
    assert ended.done(), "the follower did not end on a closed pipe"
    out, errors = ended.result()
    assert out.decode().endswith("I1 out line 0\n")
    assert b"Traceback" not in errors, errors.decode()
