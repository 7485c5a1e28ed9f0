"""A PostgreSQL add-on's backups and its recoverable window, as its instance reports them in its log
(``zattera-addon-backups <pgbackrest info --output=json>`` after each base backup and every minute,
``zattera-addon-archived time=<epoch> wal=<segment file> failed=<n>``: the newest segment in the
repository and the archiver's failures): the repository lives in the
database's ``backups`` volume on its node, and the log is what any operator's machine can read.

The window starts at the end of the oldest base backup (the earliest consistent point) and ends at the
last archived WAL segment (anything committed later is not in the archive yet: at most
``archive_timeout`` behind under writes).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

BACKUPS_MARK = "zattera-addon-backups "
ARCHIVED_MARK = "zattera-addon-archived "


@dataclass(frozen=True, slots=True)
class BaseBackup:
    label: str
    type: str
    started: float
    stopped: float
    size: int
    """Bytes of the database."""
    stored: int
    """Bytes in the repository (compressed)."""
    wal_start: str
    wal_stop: str


@dataclass(frozen=True, slots=True)
class BackupStatus:
    backups: list[BaseBackup] = field(default_factory=list)
    window_start: float = 0.0
    """Epoch seconds; 0 = no base backup yet."""
    window_end: float = 0.0
    """The last archived WAL's time; 0 = none archived yet."""
    last_archived_wal: str = ""
    archive_failures: int = 0
    reported_at: float = 0.0


def _backups(doc: Any) -> list[BaseBackup]:
    found: list[BaseBackup] = []
    for stanza in doc if isinstance(doc, list) else []:
        for b in stanza.get("backup", []) or []:
            if b.get("error"):
                continue
            info = b.get("info", {})
            found.append(
                BaseBackup(
                    label=str(b.get("label", "")),
                    type=str(b.get("type", "")),
                    started=float(b.get("timestamp", {}).get("start", 0)),
                    stopped=float(b.get("timestamp", {}).get("stop", 0)),
                    size=int(info.get("size", 0)),
                    stored=int(info.get("repository", {}).get("size", 0)),
                    wal_start=str(b.get("archive", {}).get("start", "")),
                    wal_stop=str(b.get("archive", {}).get("stop", "")),
                )
            )
    return sorted(found, key=lambda b: b.stopped)


def status_from_lines(lines: Iterable[tuple[float, str]]) -> BackupStatus | None:
    """The newest report among ``(time, line)`` log lines; None when there is none."""
    backups: list[BaseBackup] | None = None
    archived: tuple[float, str, int] | None = None
    reported = 0.0
    for at, line in lines:
        text = line.strip()
        if text.startswith(BACKUPS_MARK):
            try:
                backups = _backups(json.loads(text[len(BACKUPS_MARK) :] or "[]"))
            except (ValueError, TypeError, AttributeError):
                continue
            reported = max(reported, at)
        elif text.startswith(ARCHIVED_MARK):
            fields = dict(part.partition("=")[::2] for part in text[len(ARCHIVED_MARK) :].split())
            try:
                archived = (float(fields.get("time") or 0), fields.get("wal", ""), int(fields.get("failed") or 0))
            except ValueError:
                continue
            reported = max(reported, at)
    if backups is None and archived is None:
        return None
    backups = backups or []
    end, wal, failures = archived or (0.0, "", 0)
    start = backups[0].stopped if backups else 0.0
    return BackupStatus(backups, start, max(end, backups[-1].stopped) if backups else end, wal, failures, reported)
