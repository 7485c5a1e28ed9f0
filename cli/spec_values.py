"""The values of a ``zattera.toml`` (:mod:`cli.spec`): names, booleans, durations and sizes as the file
writes them, and the strict base model every table of the spec is built on."""

from __future__ import annotations

import re
from typing import Annotated

from google.protobuf.duration_pb2 import Duration
from pydantic import BaseModel, ConfigDict, Field, Strict

NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


Name = Annotated[str, Field(pattern=NAME, description="lowercase letters, digits and dashes")]
Flag = Annotated[bool, Strict()]
"""A TOML boolean: ``true`` or ``false``, never a string or a number that reads like one ("yes", 1)."""


def parse_duration(value: str | int | float) -> float:
    """Seconds from ``10``, ``"500ms"``, ``"10s"``, ``"5m"`` or ``"1h"``."""
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("must not be negative")
        return float(value)
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a duration like '500ms', '10s', '5m' or '1h'")
    return float(match.group(1)) * _UNITS[match.group(2)]


def to_duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


class Model(BaseModel):
    """A table of the spec: an unknown key is an error."""

    model_config = ConfigDict(extra="forbid")


_SIZE = re.compile(r"^\s*(\d+)\s*(b|kb|kib|mb|mib|gb|gib)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2, "gb": 1000**3, "gib": 1024**3}


def parse_size(value: str | int) -> int:
    """Bytes from ``1048576``, ``"512KiB"``, ``"10MB"`` or ``"1GiB"``."""
    if isinstance(value, bool):
        raise ValueError("must be a size like 1048576, '512KiB' or '10MB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a size like 1048576, '512KiB' or '10MB'")
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()]
