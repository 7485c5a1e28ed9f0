"""Output: rich tables for people, ``--json`` for scripts (protobufs as canonical JSON)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from cli.client import OPTIONS, say

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance | Message")

out = Console(soft_wrap=True, emoji=False)  # a long line (an event, an id) is never cut into two in a pipe; no
# ":name:" in a value is turned into an emoji (and rich's emoji table is not loaded)


def as_dict(msg: Message) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict  # only `--json` of messages needs it

    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def emit_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True, default=str))


def report(result: DataclassInstance | dict[str, Any], *lines: str) -> None:
    """``result`` as JSON with ``--json`` (a dataclass: its fields), else ``lines`` on stderr."""
    if json_mode():
        emit_json(result if isinstance(result, dict) else dataclasses.asdict(result))
        return
    for line in lines:
        say(line)


def messages(items: Iterable[Message]) -> None:
    emit_json([as_dict(m) for m in items])


@dataclass(frozen=True)
class Col:
    """A table column. Ids and names are never wrapped nor cut; ``wrap`` marks free text (messages, errors)
    that may wrap in a narrow terminal; ``wide`` columns are shown only with ``--wide``."""

    header: str
    wrap: bool = False
    wide: bool = False


FREE_TEXT_WIDTH = 60
"""Widest a free-text column gets in a terminal before it wraps (never in a pipe or a file)."""
UNBOUNDED = 1_000_000


def table(title: str, columns: Sequence[str | Col], rows: Iterable[Sequence[Any]]) -> None:
    """Every row in full: a table wider than the terminal (or any table written to a pipe or a file, which
    rich would cut at 80 columns) is printed at its natural width, so an id is never wrapped or cut."""
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    shown = [i for i, c in enumerate(cols) if OPTIONS.wide or not c.wide]
    t = Table(title=title, title_justify="left")
    for i in shown:
        c = cols[i]
        narrow = c.wrap and out.is_terminal
        t.add_column(c.header, no_wrap=not narrow, overflow="fold", max_width=FREE_TEXT_WIDTH if narrow else None)
    for r in rows:
        t.add_row(*[Text(str(r[i])) for i in shown])  # Text: a value is never read as rich markup
    natural = Measurement.get(out, out.options.update_width(UNBOUNDED), t).maximum
    width = out.width
    out.width = max(width, natural)
    try:
        out.print(t)
    finally:
        out.width = width


def listing(title: str, columns: Sequence[str | Col], items: Sequence[D], row: Callable[[D], Sequence[Any]]) -> None:
    """``items`` as a JSON list with ``--json`` (a dataclass: its fields; a state record: its canonical JSON), else
    as a :func:`table` of ``row(item)`` each."""
    if json_mode():
        emit_json([as_dict(item) if isinstance(item, Message) else dataclasses.asdict(item) for item in items])
        return
    table(title, columns, [row(item) for item in items])


def set_output(flag: bool, wide: bool = False) -> bool:
    """Record ``--json`` and ``--wide`` for the output below; returns ``--json``."""
    OPTIONS.json = flag
    OPTIONS.wide = wide
    return flag


def json_mode() -> bool:
    return OPTIONS.json


def ts(value: Timestamp) -> str:
    if not value.seconds and not value.nanos:
        return "-"
    return datetime.fromtimestamp(value.seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def when(seconds: float) -> str:
    """Epoch seconds as a UTC time, "-" for 0 (never)."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S") if seconds else "-"


def delivery_state(failing: bool, failing_since: float, failures: int, last_error: str, idle: str = "ok") -> str:
    """How a channel's or a drain's deliveries go: ``FAILING since …: why``, ``retrying (N failed): why``, else
    ``idle``."""
    if failing:
        return f"FAILING since {when(failing_since)}: {last_error}"
    if failures:
        return f"retrying ({failures} failed): {last_error}"
    return idle


def enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower()
