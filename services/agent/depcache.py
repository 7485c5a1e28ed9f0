"""The builder's dependency layers, cached by what decides their content.

A layer's key hashes the plan's install command, the files it reads (requirements/lockfiles, and the files
the plan generates from them) and the platform (``os/arch`` plus the interpreter or runtime the packages are
built for): an unchanged key means the install would produce the same tree, so a rebuild reuses the layer.
Layers are kept on the builder (:class:`LayerCache`) and pushed to the cluster registry as
``<repo>:deps-<key>`` (:func:`cache_tag`), where a builder without it finds it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shared.buildplan import BuildPlan
from shared.files import write_atomic

CACHE_TAG_PREFIX = "deps-"
_KEY_HEX = 32


def dependency_key(plan: BuildPlan, src: Path, platform: str) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([plan.provider, plan.install, plan.dependency_dir, platform]).encode())
    for name in plan.dependency_files:
        path = src / name
        digest.update(f"\0{name}\0".encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    for name, text in sorted(plan.generated.items()):
        digest.update(f"\0{name}\0{text}".encode())
    return digest.hexdigest()[:_KEY_HEX]


def cache_tag(key: str) -> str:
    return f"{CACHE_TAG_PREFIX}{key}"


class LayerCache:
    """``<dir>/<key>.tar.gz`` + ``<key>.json`` (its uncompressed digest); written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, key: str) -> tuple[bytes, str] | None:
        try:
            meta = json.loads((self.directory / f"{key}.json").read_text())
            return (self.directory / f"{key}.tar.gz").read_bytes(), str(meta["diff_id"])
        except (OSError, ValueError, KeyError):
            return None

    def put(self, key: str, layer: bytes, diff_id: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, data in ((f"{key}.tar.gz", layer), (f"{key}.json", json.dumps({"diff_id": diff_id}).encode())):
            write_atomic(self.directory / name, data, durable=False)  # a cache: a lost entry is built again
