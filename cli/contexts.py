"""Saved cluster connections (``zattera context``): NATS URLs, credentials file and TLS CA by name.

One JSON file, ``$ZATTERA_CONFIG_DIR/contexts.json`` (default ``~/.config/zattera/``), written with mode
0600 (it names a credentials file), replaced atomically. It holds paths, never the credentials themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, field_validator

from shared.errors import ZatteraError
from shared.files import PRIVATE, write_atomic
from shared.natssettings import config_dir

FILE_NAME = "contexts.json"


class ContextError(ZatteraError, ValueError):
    """A bad context name or value, or an unreadable contexts file: the message names which."""


class Context(BaseModel):
    nats: str = Field(description="NATS URL(s), comma-separated")
    creds: str = Field(default="", description="NATS credentials file")
    tls_ca: str = Field(default="", description="CA file the NATS server certificate must chain to")

    @field_validator("nats")
    @classmethod
    def _urls(cls, value: str) -> str:
        urls = [u.strip() for u in value.split(",") if u.strip()]
        if not urls:
            raise ValueError("at least one URL")
        for url in urls:
            if "://" not in url:
                raise ValueError(f"{url!r} is not a URL (nats://host:port)")
        return ",".join(urls)


class ContextFile(BaseModel):
    current: str = ""
    contexts: dict[str, Context] = Field(default_factory=dict)


def path() -> Path:
    return config_dir() / FILE_NAME


def load() -> ContextFile:
    file = path()
    if not file.exists():
        return ContextFile()
    try:
        return ContextFile.model_validate_json(file.read_text())
    except (OSError, ValidationError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        raise ContextError(f"{file}: not a contexts file ({first})") from None


def save(contexts: ContextFile) -> None:
    write_atomic(path(), json.dumps(contexts.model_dump(), indent=2) + "\n", mode=PRIVATE)


def check_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ContextError(f"context name {name!r}: use letters, digits, '-', '_' or '.'")
    return name


def current() -> Context | None:
    """The context in use, if any (an unreadable file raises :class:`ContextError`)."""
    contexts = load()
    return contexts.contexts.get(contexts.current) if contexts.current else None
