"""The snapshot manifest: the ordered chunk list that rebuilds the volume's tar stream."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MANIFEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class ChunkRef:
    hash: str
    size: int


@dataclass
class Manifest:
    chunks: list[ChunkRef] = field(default_factory=list)
    tar_bytes: int = 0
    created_at_unix: int = 0
    version: int = MANIFEST_VERSION

    def to_json(self) -> bytes:
        chunks = [{"hash": c.hash, "size": c.size} for c in self.chunks] or None
        body = {
            "version": self.version,
            "chunks": chunks,
            "tar_bytes": self.tar_bytes,
            "created_at_unix": self.created_at_unix,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        if body.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {body.get('version')!r}")
        chunks = [ChunkRef(str(c["hash"]), int(c["size"])) for c in body.get("chunks") or []]
        return cls(chunks=chunks, tar_bytes=int(body["tar_bytes"]), created_at_unix=int(body.get("created_at_unix", 0)))

    def hashes(self) -> set[str]:
        return {c.hash for c in self.chunks}
