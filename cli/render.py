"""Output: rich tables for people, ``--json`` for scripts (protobufs as canonical JSON)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.table import Table

from cli.client import OPTIONS

out = Console()


def as_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def emit_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True, default=str))


def messages(items: Iterable[Message]) -> None:
    emit_json([as_dict(m) for m in items])


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[str(v) for v in r])
    out.print(t)


def json_mode() -> bool:
    return OPTIONS.json


def ts(value: Timestamp) -> str:
    if not value.seconds and not value.nanos:
        return "-"
    return datetime.fromtimestamp(value.seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower()
