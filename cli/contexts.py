"""Saved cluster connections (``zattera context``): NATS URLs, credentials file and TLS CA by name.

One JSON file, ``$ZATTERA_CONFIG_DIR/contexts.json`` (default ``~/.config/zattera/``), written with mode
0600 (it names a credentials file), replaced atomically. It holds paths, never the credentials themselves.
Its models (:mod:`cli.context_models`, pydantic) are imported only when there is a file to read or write:
every command asks for the current context, and most find none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import ZatteraError
from shared.files import PRIVATE, write_atomic
from shared.natssettings import config_dir

if TYPE_CHECKING:
    from cli.context_models import Context, ContextFile

FILE_NAME = "contexts.json"


class ContextError(ZatteraError, ValueError):
    """A bad context name or value, or an unreadable contexts file: the message names which."""


def path() -> Path:
    return config_dir() / FILE_NAME


def load() -> ContextFile:
    from pydantic import ValidationError

    from cli.context_models import ContextFile

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
    if not path().exists():  # nothing saved: the models are not even imported
        return None
    contexts = load()
    return contexts.contexts.get(contexts.current) if contexts.current else None
