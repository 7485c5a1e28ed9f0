"""``zattera logs``: an environment's instance logs from its log stream (docs/logs.md)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime

import typer

from cli.client import OPTIONS, control, err, fail, run
from cli.spec_values import parse_duration
from shared.actions.names import resolve_env
from shared.applogs import STDERR, AppLogLine, UnknownLogStream, read_app_logs
from shared.ids import is_safe_id, unsafe_id

_STREAM_WAIT = 1.0
"""How often ``-f`` looks again for a log stream that does not exist yet."""


def render_line(line: AppLogLine) -> str:
    stamp = datetime.fromtimestamp(line.time_ns / 1e9, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    tag = "err" if line.stream == STDERR else "out"
    return f"{stamp} {line.instance} {tag} {line.line}"


def since_ns(value: str, now: float) -> int:
    """``--since 10m`` → the epoch nanoseconds it names; raises typer.Exit naming the option."""
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise fail(f"--since {value!r}: {exc}") from None
    return int((now - seconds) * 1e9)


def logs(
    env: str = typer.Option(..., "--env", help="the environment: project/app/env or its id"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
    lines: int = typer.Option(100, "--lines", "-n", help="how many past lines to show first (0 = none)"),
    since: str = typer.Option("", "--since", help="only lines newer than this, e.g. 10m or 2h"),
    instance: str = typer.Option("", "--instance", help="one instance (assignment id, see `zattera ps`)"),
    json_output: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> None:
    """An environment's app output (stdout and stderr of every replica) in time order; -f follows it."""
    OPTIONS.json = json_output
    if lines < 0:
        raise fail(f"-n/--lines: must be 0 or more, got {lines}")
    if instance and not is_safe_id(instance):
        raise fail(f"--instance: {unsafe_id('instance id', instance)}")
    start_ns = since_ns(since, time.time()) if since else 0

    def emit(line: AppLogLine) -> None:
        try:
            sys.stdout.write((json.dumps(line.as_json()) if json_output else render_line(line)) + "\n")
            if follow:
                sys.stdout.flush()
        except BrokenPipeError:  # the reader went away (`zattera logs -f | head`): a normal end
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None

    async def go() -> None:
        async with control() as c:
            target = resolve_env(c.view, env)
            if target is None:
                raise fail(f"--env: no environment {env!r} (use an id or project/app/env)")
            while True:
                try:
                    async for line in read_app_logs(
                        c.conn, target.meta.id, instance=instance, last=lines, since_ns=start_ns, follow=follow
                    ):
                        emit(line)
                    return
                except UnknownLogStream:
                    if not follow:
                        err.print(f"no logs for {env} yet", highlight=False)
                        return
                    await asyncio.sleep(_STREAM_WAIT)

    run(go)
