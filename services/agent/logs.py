"""Instance output → the environment's log stream (docs/logs.md).

An instance writes its stdout and stderr into two plain files of its directory (``stdout.log``,
``stderr.log``), never into a pipe: writing a file never waits for the agent, so an app never blocks on
logging, and what it writes while no agent runs (an agent restart) stays there. One
:class:`InstanceLogShipper` per instance tails both files and publishes their new lines, batched, to
``zattera.logs.<env>.<instance>``; the byte offsets shipped so far are saved in ``logs.cursor`` after each
acknowledged publish, so a restarted agent resumes exactly there: a line written before the restart is
shipped (at least once), whatever the process did meanwhile. A batch's message id names the byte ranges it
holds, so the stream's duplicate window drops only bytes it already has (a batch stored just before a crash,
read again and further by the next run, is stored again whole).

The bounded buffer is the unread part of each file: when it grows past ``max_backlog`` bytes (the stream
is unreachable, or the app writes faster than it can be shipped), the shipper skips ahead to the newest
``max_backlog / 2`` bytes, counts the complete lines it skipped and ships one line "N lines dropped" in
their place. Shipped bytes are given back to the file system (hole punching, keeping the newest
``TAIL_KEPT`` bytes for crash diagnostics), and a file wholly shipped is emptied before the next start of
the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import nats.errors
from google.protobuf.timestamp_pb2 import Timestamp
from nats.js.errors import Error as JetStreamError
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.applogs import STDERR, STDOUT, app_log_subject, app_logs_stream
from shared.connection import Connection
from shared.files import PRIVATE, write_atomic
from shared.tasks import raise_if_cancelling

if TYPE_CHECKING:
    from services.agent.settings import AgentSettings

log = logging.getLogger(__name__)

STREAM_FILES = {STDOUT: "stdout.log", STDERR: "stderr.log"}
CURSOR_FILE = "logs.cursor"
TAIL_KEPT = 64 * 1024
"""Bytes before the cursor never punched out: the stderr tail stays readable for a crash report."""
TAIL_READ = 16 * 1024
"""Bytes read back from the end of stderr for a crash report."""
_PUNCH_STEP = 1024 * 1024
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_READ_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class ShipperSettings:
    poll_interval: float = 0.05
    max_backlog: int = 8 * 1024 * 1024
    batch_bytes: int = 512 * 1024
    batch_lines: int = 8192
    max_line: int = 16 * 1024
    stderr_tail: int = 20
    retry: float = 1.0

    @classmethod
    def of(cls, settings: AgentSettings) -> ShipperSettings:
        """What the agent's settings say."""
        return cls(
            poll_interval=settings.log_poll_interval,
            max_backlog=settings.log_max_backlog,
            batch_bytes=settings.log_batch_bytes,
            batch_lines=settings.log_batch_lines,
            stderr_tail=settings.log_stderr_tail,
        )


@dataclass
class Cursor:
    """Shipped bytes per stream file; ``generation`` changes whenever the files are emptied;
    ``stderr_run_start`` is where the current run of the process began writing stderr."""

    generation: int = 0
    offsets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STREAM_FILES, 0))
    stderr_run_start: int = 0

    def save(self, directory: Path) -> None:
        doc = {"generation": self.generation, "offsets": self.offsets, "stderr_run_start": self.stderr_run_start}
        # Saved after every shipped batch: whole, not synced (a crash re-ships a batch the stream drops).
        write_atomic(directory / CURSOR_FILE, json.dumps(doc), mode=PRIVATE, durable=False)

    def copy(self) -> Cursor:
        return replace(self, offsets=dict(self.offsets))

    @classmethod
    def load(cls, directory: Path) -> Cursor | None:
        """The saved cursor; None when there is no cursor file (an unreadable one reads as a fresh cursor)."""
        try:
            doc = json.loads((directory / CURSOR_FILE).read_text())
            offsets = {name: int(doc["offsets"].get(name, 0)) for name in STREAM_FILES}
            return cls(
                generation=int(doc["generation"]),
                offsets=offsets,
                stderr_run_start=int(doc.get("stderr_run_start", 0)),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return cls()


def open_output_files(directory: Path) -> dict[str, int]:
    """File descriptors (append mode) the process gets as its stdout and stderr; the caller closes them."""
    return {
        name: os.open(directory / filename, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        for name, filename in STREAM_FILES.items()
    }


def split_lines(data: bytes, *, final: bool, max_line: int, max_lines: int) -> tuple[list[bytes], int]:
    """Complete lines of ``data`` (without their newline) and how many bytes they used. A line longer than
    ``max_line`` is cut into pieces; with ``final`` (the process is gone) a last unterminated line counts.
    At most ``max_lines`` lines (a message must stay under the NATS payload limit however short they are)."""
    if data.count(b"\n") > max_lines:
        end = -1
        for _ in range(max_lines):
            end = data.find(b"\n", end + 1)
        data, final = data[: end + 1], False
    lines: list[bytes] = []
    used = 0
    end = data.rfind(b"\n") + 1
    if end:
        lines = data[: end - 1].split(b"\n")
        used = end
    rest = len(data) - used
    if rest and (final or rest >= max_line):
        lines.append(data[used:])
        used = len(data)
    if any(len(line) > max_line for line in lines):
        lines = [line[i : i + max_line] for line in lines for i in range(0, max(len(line), 1), max_line)]
    return lines, used


def count_lines(fd: int, start: int, end: int) -> int:
    """Newlines between two offsets of a file."""
    count = 0
    while start < end:
        chunk = os.pread(fd, min(_READ_CHUNK, end - start), start)
        if not chunk:
            break
        count += chunk.count(b"\n")
        start += len(chunk)
    return count


_libc: ctypes.CDLL | None = None


def punch_hole(fd: int, length: int) -> bool:
    """Give the first ``length`` bytes of a file back to the file system, offsets unchanged (Linux)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fallocate = _libc.fallocate
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
    return bool(fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length) == 0)


class _Source:
    """One output file being tailed."""

    def __init__(self, stream: str, path: Path) -> None:
        self.stream = stream
        self.path = path
        self.punched = 0
        self.fd = -1

    def open(self) -> bool:
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.open() else 0


class InstanceLogShipper:
    """Tails one instance's output files and ships their lines; see the module docstring."""

    def __init__(
        self,
        conn: Connection,
        directory: Path,
        *,
        environment_id: str,
        instance_id: str,
        node_id: str,
        settings: ShipperSettings,
        time_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.conn = conn
        self.directory = directory
        self.settings = settings
        self.release_id = ""
        self.dropped_total = 0
        self.shipped_lines = 0
        self._time_ns = time_ns
        self._last_ns = 0
        self._subject = app_log_subject(environment_id, instance_id)
        self._stream = app_logs_stream(environment_id)
        self._tags = cpb.InstanceLogBatch(environment_id=environment_id, instance_id=instance_id, node_id=node_id)
        self._saved = Cursor.load(directory)
        """The cursor as in the file; None: no file (a fresh instance directory, nothing shipped from it)."""
        self._cursor = self._saved.copy() if self._saved is not None else Cursor()
        self._sources = [_Source(s, directory / f) for s, f in STREAM_FILES.items()]
        self._pending: cpb.InstanceLogBatch | None = None
        self._pending_offsets: dict[str, int] = {}
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ what the supervisor uses

    def stderr_tail(self) -> list[str]:
        """The last stderr lines of the current run of the process, read from the file itself: they are
        there whether or not they could be shipped (NATS away, no stream yet)."""
        source = next(s for s in self._sources if s.stream == STDERR)
        size = source.size()
        start = max(self._cursor.stderr_run_start, size - TAIL_READ)
        if size <= start:
            return []
        lines = os.pread(source.fd, size - start, start).split(b"\n")
        if start > self._cursor.stderr_run_start:
            lines = lines[1:]  # the first one is cut
        text = [line.decode("utf-8", "replace") for line in lines if line.strip(b"\0")]
        return text[max(0, len(text) - self.settings.stderr_tail) :] if self.settings.stderr_tail else []

    async def run(self) -> None:
        """Ship until cancelled; a failed publish is retried (the unread bytes wait in the files)."""
        try:
            while True:
                try:
                    shipped = await self.pump(final=False)
                except (nats.errors.Error, JetStreamError, TimeoutError) as exc:
                    raise_if_cancelling()
                    log.debug("%s: shipping logs failed (%s); retrying", self._subject, exc)
                    await asyncio.sleep(self.settings.retry)
                    continue
                raise_if_cancelling()  # nats-py's publish may have absorbed our cancellation
                if not shipped:
                    await asyncio.sleep(self.settings.poll_interval)
        finally:
            for source in self._sources:
                source.close()

    async def drain(self, timeout: float) -> None:
        """Ship everything written so far, unterminated last lines included (the process has exited)."""
        with contextlib.suppress(nats.errors.Error, JetStreamError, TimeoutError):
            async with asyncio.timeout(timeout):
                while await self.pump(final=True):
                    pass

    def process_starting(self) -> None:
        """Before the process starts (again): its stderr tail starts afresh, and the files are emptied when
        everything in them was shipped. A first start in a fresh directory (no cursor file, no output file)
        writes nothing: there is nothing to empty, and no byte was ever shipped under the cursor's
        generation."""
        opened = [s.open() for s in self._sources]
        if self._saved is None and not any(opened):
            return
        if self._pending is None and all(s.size() <= self._cursor.offsets[s.stream] for s in self._sources):
            # The new generation is on disk before the files are emptied: a crash in between re-ships the
            # old lines under new ids (duplicates) rather than new lines under ids the stream already holds.
            self._cursor = Cursor(generation=self._cursor.generation + 1)
            self._save_cursor()
            for source in self._sources:
                if source.open():
                    os.ftruncate(source.fd, 0)
                source.punched = 0
        self._cursor.stderr_run_start = next(s for s in self._sources if s.stream == STDERR).size()
        self._save_cursor()  # after the files were emptied it is unchanged (0): no second write

    def _save_cursor(self) -> None:
        """Write the cursor unless the file already says the same (no file reads as a fresh cursor)."""
        if self._cursor != (self._saved if self._saved is not None else Cursor()):
            self._cursor.save(self.directory)
            self._saved = self._cursor.copy()

    # ------------------------------------------------------------------ reading and shipping

    async def pump(self, *, final: bool) -> bool:
        """Read and publish one batch; False when there was nothing new. Raises when the publish fails."""
        async with self._lock:
            return await self._pump(final=final)

    async def _pump(self, *, final: bool) -> bool:
        if self._pending is None and not self._read(final=final):
            return False
        assert self._pending is not None
        await self.conn.js.publish(
            self._subject,
            self._pending.SerializeToString(),
            stream=self._stream,
            timeout=5.0,
            headers={"Nats-Msg-Id": self._batch_id()},
        )
        self.shipped_lines += len(self._pending.lines)
        self._pending = None
        self._cursor.offsets = dict(self._pending_offsets)
        self._save_cursor()
        self._give_back_space()
        return True

    def _batch_id(self) -> str:
        """The pending batch's ``Nats-Msg-Id``: the byte ranges it holds of each file. Only the very same
        bytes get the same id, so the stream's duplicate window drops a batch only when it already holds
        those bytes (a retry after an unacknowledged publish, the same batch read again after a restart); a
        batch that starts where an earlier one did but reaches further is a new message."""
        first, last = self._cursor.offsets, self._pending_offsets
        spans = ":".join(f"{first[stream]}-{last[stream]}" for stream in STREAM_FILES)
        return f"{self._subject}:{self._cursor.generation}:{spans}"

    def _now(self) -> Timestamp:
        # Strictly increasing per instance: the readers' time order is then the order of the files.
        self._last_ns = max(self._time_ns(), self._last_ns + 1)
        stamp = Timestamp()
        stamp.FromNanoseconds(self._last_ns)
        return stamp

    def _read(self, *, final: bool) -> bool:
        """Fill the pending batch from both files; False when they hold nothing new."""
        offsets = dict(self._cursor.offsets)
        lines: dict[str, list[bytes]] = {STDOUT: [], STDERR: []}
        dropped: dict[str, int] = {STDOUT: 0, STDERR: 0}
        budget_used = 0
        # stderr first, up to half a batch; stdout gets the rest: neither starves the other.
        cfg = self.settings
        budget, lines_left = cfg.batch_bytes // 2, cfg.batch_lines // 2
        for source in reversed(self._sources):
            if source.stream == STDOUT:
                budget = cfg.batch_bytes - budget_used
                lines_left = cfg.batch_lines - len(lines[STDERR]) - bool(dropped[STDERR])
            size = source.size()
            offset = offsets[source.stream]
            if size < offset:  # emptied under us (a new generation): start over
                offset = 0
            if size - offset > self.settings.max_backlog:
                offset, dropped[source.stream] = self._skip(source, offset, size)
            if size <= offset:
                offsets[source.stream] = offset
                continue
            data = os.pread(source.fd, min(budget, size - offset), offset)
            taken, used = split_lines(data, final=final, max_line=self.settings.max_line, max_lines=lines_left)
            lines[source.stream] = taken
            offsets[source.stream] = offset + used
            budget_used += used
        if not any(lines.values()) and not any(dropped.values()):
            self._cursor.offsets = offsets  # only cut bytes: nothing to publish
            return False
        batch = cpb.InstanceLogBatch()
        batch.CopyFrom(self._tags)
        batch.release_id = self.release_id
        add = batch.lines.add
        # What one read finds on both streams is stamped stdout first: the order of the two within a poll
        # is unknown, and an app's buffered stdout was written before what it just put on stderr (a crash
        # leaves its traceback last, as on a terminal).
        for stream in (STDOUT, STDERR):
            if not lines[stream] and not dropped[stream]:
                continue
            stamp = self._now()
            if dropped[stream]:
                add(time=stamp, line=f"{dropped[stream]} lines dropped", stream=stream, dropped=dropped[stream])
            for raw in lines[stream]:
                add(time=stamp, line=raw.decode("utf-8", "replace"), stream=stream)
        self._pending, self._pending_offsets = batch, offsets
        return True

    def _skip(self, source: _Source, offset: int, size: int) -> tuple[int, int]:
        """Drop the oldest unread bytes down to half the backlog bound, at a line start: the new offset, and
        how many lines were dropped."""
        target = size - self.settings.max_backlog // 2
        head = os.pread(source.fd, min(self.settings.max_line, size - target), target)
        newline = head.find(b"\n")
        target = target + newline + 1 if newline >= 0 else target
        dropped = count_lines(source.fd, offset, target)
        self.dropped_total += dropped
        return target, dropped

    def _give_back_space(self) -> None:
        for source in self._sources:
            keep_from = ((self._cursor.offsets[source.stream] - TAIL_KEPT) // 4096) * 4096
            if keep_from - source.punched >= _PUNCH_STEP and source.open():
                if punch_hole(source.fd, keep_from):
                    source.punched = keep_from
                else:
                    source.punched = 1 << 62  # not supported here: the file is emptied between runs only
                    reason = errno.errorcode.get(ctypes.get_errno())
                    log.debug("%s: hole punching unsupported (%s)", source.path, reason)
