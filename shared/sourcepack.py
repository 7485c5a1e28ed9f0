"""Source upload for ``zattera deploy DIR`` and git deploys: a deterministic tarball stored in ``zattera-sources``.

The tarball is named by its content (``sha256:<hex>``), so uploading the same tree twice stores it
once. Entries are sorted, owners and times are normalised, and VCS / virtualenv / cache folders are
left out, so the digest depends only on the files.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from nats.js.errors import NotFoundError, ObjectNotFoundError

from shared.connection import Connection
from shared.subjects import SOURCES_STORE

EXCLUDED_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "__pycache__", "node_modules", ".mypy_cache", ".zattera"}
MAX_SOURCE_BYTES = 512 * 1024 * 1024


def pack(directory: Path) -> bytes:
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT, compresslevel=6) as tar:
        for path in _files(directory):
            rel = path.relative_to(directory).as_posix()
            info = tar.gettarinfo(str(path), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755 if info.mode & 0o111 else 0o644
            if info.isfile():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            elif info.issym():
                tar.addfile(info)
    data = buffer.getvalue()
    if len(data) > MAX_SOURCE_BYTES:
        raise ValueError(f"source tarball is {len(data)} bytes; the limit is {MAX_SOURCE_BYTES}")
    return data


def _files(directory: Path) -> list[Path]:
    found: list[Path] = []
    for path in sorted(directory.rglob("*")):
        if any(part in EXCLUDED_DIRS for part in path.relative_to(directory).parts):
            continue
        if path.is_file() or path.is_symlink():
            found.append(path)
    return found


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


async def upload(conn: Connection, data: bytes) -> str:
    """Store the tarball unless already there; returns its digest."""
    name = digest(data)
    store = await conn.js.object_store(SOURCES_STORE)
    try:
        await store.get_info(name)
        return name
    except (ObjectNotFoundError, NotFoundError):
        pass
    await store.put(name, data)
    return name
