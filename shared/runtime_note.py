"""The runtime an agent chose for its node and why, and how it isolates apps, in a small file of its data
directory (``runtime.json``): written by the agent at each start, read by ``zattera up`` to say on the
terminal which runtime the local node uses and whether its apps are sandboxed (a fallback to bare processes
must not hide in a log file). Imports nothing heavy: the ``zattera
up`` supervisor reads it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

RUNTIME_NOTE = "runtime.json"


@dataclass(frozen=True)
class RuntimeNote:
    runtime: str
    """``process`` or ``docker``."""
    reason: str
    isolation: str = ""
    """How its apps and builds are isolated, in words (``services/agent/sandbox.py`` ``Isolation.describe``)."""


def write_runtime_note(data_dir: Path, runtime: str, reason: str, isolation: str = "") -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    temporary = data_dir / (RUNTIME_NOTE + ".tmp")
    temporary.write_text(json.dumps({"runtime": runtime, "reason": reason, "isolation": isolation}))
    os.replace(temporary, data_dir / RUNTIME_NOTE)


def read_runtime_note(data_dir: Path) -> RuntimeNote | None:
    """What the agent last wrote; None when it has not (yet) or the file is unreadable."""
    try:
        doc = json.loads((data_dir / RUNTIME_NOTE).read_text())
        return RuntimeNote(str(doc["runtime"]), str(doc["reason"]), str(doc.get("isolation", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
