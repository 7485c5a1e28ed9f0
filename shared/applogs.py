"""Instance logs on NATS (docs/logs.md): one JetStream stream per environment, one subject per instance.

The agent publishes an instance's stdout and stderr as :class:`InstanceLogBatch` messages on
``zattera.logs.<env>.<instance>`` into the stream ``ZATTERA_LOGS_<env>``. A stream per environment is what
makes retention per environment exact: JetStream enforces ``max_bytes`` and ``max_age`` per stream, so one
noisy environment can never evict another's lines, and no trimming loop is needed. The builds service's
log-streams loop creates and resizes these streams from the environments (``Environment.logs`` over the
cluster defaults); this module holds the names, the stream configuration and the reading side used by
``zattera logs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.watches import Watch, WatchSpec
from shared.watches import follow as follow_watch

APP_LOGS_SUBJECT_PREFIX = "zattera.logs."
APP_LOGS_STREAM_PREFIX = "ZATTERA_LOGS_"
STDOUT = "stdout"
STDERR = "stderr"
_FIRST_WINDOW = 64
"""Messages read back first when looking for the last N lines; the window grows until N lines are found."""


def app_log_subject(env_id: str, instance_id: str = "*") -> str:
    return f"{APP_LOGS_SUBJECT_PREFIX}{env_id}.{instance_id}"


def app_logs_stream(env_id: str) -> str:
    return APP_LOGS_STREAM_PREFIX + env_id


def env_of_stream(name: str) -> str:
    """The environment id of a log stream's name, or '' for any other stream."""
    return name.removeprefix(APP_LOGS_STREAM_PREFIX) if name.startswith(APP_LOGS_STREAM_PREFIX) else ""


@dataclass(frozen=True, slots=True)
class LogLimits:
    max_bytes: int
    max_age: float  # seconds


def retention_of(env: pb.Environment, default: LogLimits) -> LogLimits:
    """The environment's own limits (``[env.<name>.logs]`` in zattera.toml) over the cluster defaults; a value
    that is not positive (never written by ``apps apply``, which refuses it) counts as unset."""
    max_age = env.logs.max_age.ToNanoseconds() / 1e9 if env.logs.HasField("max_age") else 0.0
    return LogLimits(
        max_bytes=env.logs.max_bytes if env.logs.max_bytes > 0 else default.max_bytes,
        max_age=max_age if max_age > 0 else default.max_age,
    )


def app_logs_stream_config(env_id: str, retention: LogLimits, replicas: int) -> StreamConfig:
    """The oldest messages go first when a limit is reached (DiscardPolicy.OLD): logging never stops."""
    return StreamConfig(
        name=app_logs_stream(env_id),
        subjects=[app_log_subject(env_id, "*")],
        max_bytes=retention.max_bytes,
        max_age=retention.max_age,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_direct=True,
    )


# ---------------------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class AppLogLine:
    """One line as ``zattera logs`` shows it: the batch's tags joined in."""

    time_ns: int
    stream: str
    line: str
    instance: str
    node: str
    release: str
    dropped: int = 0

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "time": self.time_ns / 1e9,
            "stream": self.stream,
            "line": self.line,
            "instance": self.instance,
            "node": self.node,
            "release": self.release,
        }
        if self.dropped:
            doc["dropped"] = self.dropped
        return doc


def lines_of(data: bytes) -> list[AppLogLine]:
    batch = cpb.InstanceLogBatch.FromString(data)
    return [
        AppLogLine(
            time_ns=line.time.ToNanoseconds(),
            stream=line.stream,
            line=line.line,
            instance=batch.instance_id,
            node=batch.node_id,
            release=batch.release_id,
            dropped=line.dropped,
        )
        for line in batch.lines
    ]


class UnknownLogStream(ZatteraError):
    """The environment has no log stream (yet): nothing was ever logged, or the builds service is not running."""


async def read_app_logs(
    conn: Connection,
    env_id: str,
    *,
    instance: str = "",
    last: int = 100,
    since_ns: int = 0,
    follow: bool = False,
    idle: float = 10.0,
) -> AsyncIterator[AppLogLine]:
    """The last ``last`` lines (newer than ``since_ns`` when given) across the env's instances in time order;
    with ``follow``, then every new line as it is stored. Raises :class:`UnknownLogStream`. Read through a
    watch control opens (:mod:`shared.watches`): the operator credential creates no consumer. The backlog
    ends when the watch has delivered what was stored at its start; ``idle`` only bounds a wait for the
    next stored message (a loaded machine took over 1 s and the backlog came back empty)."""
    stream = app_logs_stream(env_id)
    subject = app_log_subject(env_id, instance or "*")
    try:
        info = await conn.js.stream_info(stream)
    except NotFoundError:
        raise UnknownLogStream(f"no log stream for environment {env_id} yet") from None
    first, end = int(info.state.first_seq), int(info.state.last_seq)
    window = max(_FIRST_WINDOW, last)
    while True:
        start = max(first, end - window + 1)
        if since_ns:
            spec = WatchSpec(stream, (subject,), "by_start_time", start_time_ns=since_ns)
        else:
            spec = WatchSpec(stream, (subject,), "by_start_sequence", start_seq=max(start, 1))
        sub = await follow_watch(conn, spec)
        try:
            backlog = await _drain_until(sub, end, idle) if end else []
            enough = since_ns or start <= first or sum(1 for line in backlog if line.time_ns >= since_ns) >= last
            if not enough:
                window *= 8
                continue
            backlog = [line for line in backlog if line.time_ns >= since_ns]
            backlog.sort(key=lambda line: line.time_ns)  # stable: one instance's lines keep their order
            for line in backlog[max(0, len(backlog) - last) :] if last else []:
                yield line
            while follow:
                msg = await sub.next_msg(timeout=None)
                for line in lines_of(msg.data):
                    yield line
            return
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(sub.unsubscribe())


async def _drain_until(sub: Watch, end: int, idle: float) -> list[AppLogLine]:
    """Every line of the watch's messages up to stream sequence ``end`` (or none left to read)."""
    lines: list[AppLogLine] = []
    while True:
        msg = await sub.next_stored(idle)
        if msg is None:
            return lines  # nothing (more) matches the filter up to the end
        lines.extend(lines_of(msg.data))
        if msg.metadata.sequence.stream >= end or msg.metadata.num_pending == 0:
            return lines


# ---------------------------------------------------------------------------------------- crash diagnostics


def instance_exit(code: int | None, stderr_tail: list[str], *, now_ns: int) -> pb.InstanceExit:
    """How a process ended, for the observed state: a negative code is the killing signal (asyncio)."""
    exit_ = pb.InstanceExit(stderr_tail=stderr_tail)
    exit_.at.FromNanoseconds(now_ns)
    if code is not None and code < 0:
        exit_.signal = -code
        exit_.oom_suspected = -code == signal.SIGKILL  # the agent's own SIGKILLs never get here (only unexpected exits)
    elif code is not None:
        exit_.code_known = True
        exit_.code = code
    return exit_


# Python's ImportError and Node's require() failure, as they print it.
_MISSING_MODULE = (re.compile(r"No module named '([^']+)'"), re.compile(r"Cannot find module '([^']+)'"))


def missing_module(stderr_tail: Sequence[str]) -> str:
    """The module an app could not import, from its last stderr lines ("" when none is named)."""
    for line in reversed(stderr_tail):
        for pattern in _MISSING_MODULE:
            match = pattern.search(line)
            if match:
                return match.group(1)
    return ""


def describe_exit(exit_: pb.InstanceExit) -> str:
    """``exit code 3``, ``killed by SIGKILL (likely out of memory)``, ``exit status unknown``; an app that
    failed importing a module says which: ``exit code 1, missing module 'flask' (...)``."""
    missing = missing_module(exit_.stderr_tail)
    described = _describe_status(exit_)
    if missing:
        described += f", missing module {missing!r} (is it in the app's requirements or package.json?)"
    return described


def _describe_status(exit_: pb.InstanceExit) -> str:
    if exit_.signal:
        try:
            name = signal.Signals(exit_.signal).name
        except ValueError:
            name = f"signal {exit_.signal}"
        if exit_.oom_killed:
            return f"killed by {name} (out of memory: its memory limit)"
        return f"killed by {name}" + (" (likely out of memory)" if exit_.oom_suspected else "")
    if exit_.code_known:
        return f"exit code {exit_.code}"
    return "exit status unknown"
