"""A small asyncio client of HAProxy's runtime API (the ``stats socket``, and the master CLI).

No maintained asyncio library covers it (PyPI has synchronous, years-old wrappers), and the protocol is
lines over a unix socket: a batch of commands is sent on one connection in interactive ``prompt`` mode
and the answers are split at each ``"\\n> "`` prompt, so 10,000 map entries cost one connection.
Payload commands (``add map … <<``) end with an empty line, as the protocol wants.
"""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import Sequence
from pathlib import Path

from shared.errors import ZatteraError

PROMPT = b"\n> "
BATCH = 1000
"""Commands per connection: bounds what HAProxy buffers for one client."""


class RuntimeAPIError(ZatteraError):
    """A runtime API command answered with an error."""


async def execute(socket_path: Path, commands: Sequence[str], *, timeout: float = 10.0) -> list[str]:
    """Run ``commands`` in order; returns each one's answer (without the prompt)."""
    answers: list[str] = []
    for start in range(0, len(commands), BATCH):
        answers += await _execute_batch(socket_path, commands[start : start + BATCH], timeout)
    return answers


async def _execute_batch(socket_path: Path, commands: Sequence[str], timeout: float) -> list[str]:
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        try:
            writer.write(b"prompt\n")
            for command in commands:
                writer.write(command.encode() + (b"\n" if not command.endswith("\n") else b""))
            writer.write(b"quit\n")
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
    parts = data.split(PROMPT)
    # The first prompt follows the answer of "prompt" itself (empty); the last part is what "quit" left.
    answers = [part.decode(errors="replace").strip("\n") for part in parts[1 : 1 + len(commands)]]
    if len(answers) < len(commands):
        raise RuntimeAPIError(f"runtime API closed after {len(answers)} of {len(commands)} answers")
    return answers


async def command(socket_path: Path, line: str, *, timeout: float = 10.0) -> str:
    return (await execute(socket_path, [line], timeout=timeout))[0]


def parse_stat_csv(text: str) -> list[dict[str, str]]:
    """``show stat`` CSV (its header starts with ``# ``) → one dict per row."""
    body = text.removeprefix("# ")
    return [row for row in csv.DictReader(io.StringIO(body)) if row.get("pxname")]


async def send(socket_path: Path, line: str, *, timeout: float = 10.0) -> None:
    """Send one command without waiting for an answer (the master's ``reload`` closes the connection)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            await reader.read()
        finally:
            writer.close()


async def ask(socket_path: Path, line: str, *, timeout: float = 10.0) -> str:
    """One command in non-interactive mode, its whole answer (the master CLI answers once the client stops
    sending, then closes)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        try:
            writer.write(line.encode() + b"\n")
            writer.write_eof()
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
    return data.decode(errors="replace")


async def prepare_map(socket_path: Path, path: Path) -> str:
    """A new, empty version of the map at ``path`` (``prepare map``), to fill and commit."""
    answer = await command(socket_path, f"prepare map {path}")
    version = answer.rsplit(":", 1)[-1].strip()
    if not version.isdigit():
        raise RuntimeAPIError(f"prepare map: {answer}")
    return version


async def worker_pid(socket_path: Path) -> int | None:
    """The pid of the worker answering on the stats socket; None when none answers."""
    try:
        info = await command(socket_path, "show info", timeout=2)
    except (OSError, TimeoutError, RuntimeAPIError):
        return None
    for line in info.splitlines():
        if line.startswith("Pid:"):
            return int(line.split(":", 1)[1])
    return None


def refused(answer: str) -> bool:
    """Whether a command's answer says HAProxy did not do it."""
    lowered = answer.lower()
    return any(word in lowered for word in ("unknown", "error", "not ", "no such", "invalid", "require", "cannot"))
