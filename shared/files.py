"""Writing a file whole: a crash leaves the old content or the new, never a mix, and a private file is
never readable by others, not even for a moment.

:func:`write_atomic` writes a fresh temporary file beside the target (created with its final mode), syncs
it, renames it over the target and syncs the directory. ``durable=False`` skips the two syncs for a file
that is only a hint, rebuilt or re-read safely after a crash (a log cursor), where a sync per write would
cost more than the loss of the last write. :func:`create_once` links the file into place instead: it is
written unless it exists (of two replicas creating it together, one wins and both read the winner's).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

PRIVATE = 0o600
"""Keys, credentials, sealed material, caches holding them: the owner alone."""
PUBLIC = 0o644
"""Configuration and data others may read (a CA certificate users trust, HAProxy's configuration)."""


def prepared_file(path: Path, data: bytes | str, *, mode: int = PUBLIC, durable: bool = True) -> Path:
    """``data`` in a fresh temporary file beside ``path``, created with ``mode`` (and synced when
    ``durable``); the caller renames or links it into place. The directory is made when missing: 0700 for
    a private file, else 0755."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")  # concurrent writers never share one
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:  # the directory is missing (made here, not tried again at every write)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if mode & 0o077 == 0 else 0o755)
        fd = os.open(tmp, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed the creation mode
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def write_atomic(path: Path, data: bytes | str, *, mode: int = PUBLIC, durable: bool = True) -> Path:
    """Replace ``path`` with ``data`` whole (see the module); returns ``path``."""
    tmp = prepared_file(path, data, mode=mode, durable=durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        sync_directory(path.parent)
    return path


def create_once(path: Path, data: bytes | str, *, mode: int = PUBLIC) -> bool:
    """Write ``path`` whole unless it exists; True when this call created it."""
    tmp = prepared_file(path, data, mode=mode)
    try:
        os.link(tmp, path)  # atomic, and fails rather than replace an existing file
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    sync_directory(path.parent)
    return True


def sync_directory(directory: Path) -> None:
    """Make a rename or a link in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private_json(path: Path, doc: object) -> None:
    """Replace ``path`` atomically with ``doc`` as JSON; the file is 0600 from creation, never briefly readable."""
    write_atomic(path, json.dumps(doc), mode=PRIVATE)
