"""The manifest of one backup: what it holds, each object's SHA-256 and size, and what it was taken from.

A backup ``<id>`` on a target is ``backups/<id>/manifest.json`` plus its objects, stored by content as
``blobs/<sha256>`` and shared between backups (an object the target already holds is not sent again). The
manifest is JSON; everything here is pure so it can be table-tested.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.errors import ZatteraError

FORMAT = 1
"""The manifest's own format; a manifest of a newer format is refused."""

STATE = "state"
CONSOLE_USERS = "console-users"
SECRETS_KEY = "secrets-key"
SOURCES = "sources"
IMAGES = "images"
SNAPSHOTS = "snapshots"
KINDS = (STATE, CONSOLE_USERS, SECRETS_KEY, SOURCES, IMAGES, SNAPSHOTS)
"""What an object is: the state keys at one revision, the console users, the sealed cluster secrets key,
an object of the sources or images object store, an object of the snapshots store (the manifest and chunks
of a volume's latest COMPLETE snapshot, stored bytes as they are; ``meta`` names the snapshot and volume)."""


class BackupError(ZatteraError):
    """A backup cannot be read, trusted or restored; the message names the backup and the object."""


class Corrupt(BackupError):
    """An object of a backup is missing, truncated or altered (its SHA-256 or size differs)."""


class TooNew(BackupError):
    """The backup comes from a newer schema or manifest format than this code knows."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_name(digest: str) -> str:
    return f"blobs/{digest}"


def manifest_name(backup_id: str) -> str:
    return f"backups/{backup_id}/manifest.json"


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    """The object's own name (its object-store name; the kind again for the single objects)."""
    sha256: str
    size: int
    meta: dict[str, Any] = field(default_factory=dict)
    """What restoring it needs besides its bytes (an object store entry's description and headers)."""

    @property
    def label(self) -> str:
        return self.kind if self.kind == self.name else f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class Manifest:
    id: str
    created_at: float
    version: str
    """The Zattera version that took it."""
    schema: int
    """The cluster's schema (shared/migrations) when it was taken."""
    revision: int
    """The state stream's revision the state object holds."""
    cluster_id: str
    entries: tuple[Entry, ...]
    format: int = FORMAT

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def entry(self, kind: str, name: str | None = None) -> Entry | None:
        return next((e for e in self.entries if e.kind == kind and e.name == (name or kind)), None)

    def of_kind(self, kind: str) -> list[Entry]:
        return [e for e in self.entries if e.kind == kind]

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["entries"] = [asdict(e) for e in self.entries]
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for e in self.entries:
            counts[e.kind] = counts.get(e.kind, 0) + 1
        return {
            "id": self.id,
            "created_at": self.created_at,
            "version": self.version,
            "schema": self.schema,
            "revision": self.revision,
            "cluster_id": self.cluster_id,
            "objects": len(self.entries),
            "bytes": self.size,
            "kinds": counts,
        }


def parse_manifest(backup_id: str, data: bytes) -> Manifest:
    """The manifest from its JSON; :class:`Corrupt` naming the backup when it is not one, :class:`TooNew`
    for a newer format."""
    try:
        doc = json.loads(data)
        fmt = int(doc.get("format", 0))
        if fmt > FORMAT:
            raise TooNew(f"backup {backup_id}: manifest format {fmt} is newer than this Zattera reads ({FORMAT})")
        entries = tuple(
            Entry(str(e["kind"]), str(e["name"]), str(e["sha256"]), int(e["size"]), dict(e.get("meta") or {}))
            for e in doc["entries"]
        )
        return Manifest(
            id=str(doc["id"]),
            created_at=float(doc["created_at"]),
            version=str(doc["version"]),
            schema=int(doc["schema"]),
            revision=int(doc["revision"]),
            cluster_id=str(doc.get("cluster_id", "")),
            entries=entries,
            format=fmt,
        )
    except TooNew:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Corrupt(f"backup {backup_id}: manifest.json is not a backup manifest ({type(exc).__name__})") from None


def check_object(backup_id: str, entry: Entry, data: bytes | None) -> bytes:
    """``data`` when it is the entry's object, else :class:`Corrupt` naming it (missing, truncated, altered)."""
    if data is None:
        raise Corrupt(f"backup {backup_id}: object {entry.label} ({blob_name(entry.sha256)}) is missing")
    if len(data) != entry.size:
        raise Corrupt(
            f"backup {backup_id}: object {entry.label} is {len(data)} bytes, expected {entry.size} (truncated?)"
        )
    if sha256(data) != entry.sha256:
        raise Corrupt(f"backup {backup_id}: object {entry.label} does not match its SHA-256 (altered)")
    return data


def check_restorable(manifest: Manifest, schema: int) -> None:
    """:class:`TooNew` when the backup's schema is newer than ``schema`` (this code's)."""
    if manifest.schema > schema:
        raise TooNew(
            f"backup {manifest.id} was taken at schema {manifest.schema} (Zattera {manifest.version}); this "
            f"Zattera knows schema {schema}: upgrade Zattera before restoring it"
        )
