"""The deterministic tar stream of a volume directory, cut into chunks for snapshots, and its guarded
extraction on restore (nothing lands outside the target directory).

Byte-identical trees (same names, contents, modes, owners and whole-second mtimes) give byte-identical
streams, so unchanged data chunks to the same content-defined chunks and deduplicates:

- every path under the root (root excluded), relative with ``/``, sorted as plain strings;
- headers from ``lstat``: PAX format, mtime truncated to seconds, no atime/ctime, uid/gid/mode kept,
  user and group *names* left empty (they depend on the host's passwd database, not on the data);
- symlinks store their target; hard links are stored as separate regular files;
- sockets, FIFOs and devices are skipped (an agent cannot recreate them meaningfully).

The stream reads the live directory: a file that changes size while it is read is padded or cut to the
size its header announced, so the stream stays a valid tar (crash-consistent: a snapshot of a running
app is what a crash at that moment would have left).
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from shared.errors import ZatteraError

BLOCK = tarfile.BLOCKSIZE
READ_SIZE = 1 << 20


class UnsafeArchiveError(ZatteraError):
    """An archive member would land outside the restore root (tar-slip) or is malformed."""


def tree_paths(root: Path) -> list[str]:
    """Every path under ``root`` (relative, ``/``-separated), sorted as plain strings."""
    found: list[str] = []

    def walk(folder: str, prefix: str) -> None:
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = prefix + entry.name
                found.append(rel)
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, rel + "/")

    walk(str(root), "")
    found.sort()
    return found


def tar_header(root: Path, rel: str) -> tarfile.TarInfo | None:
    """The deterministic header of one path, or None for types a tar stream does not carry."""
    path = os.path.join(root, rel)
    st = os.lstat(path)
    info = tarfile.TarInfo(rel)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.uname = info.gname = ""
    info.mtime = int(st.st_mtime)
    if stat.S_ISREG(st.st_mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
    elif stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
    else:
        return None
    return info


class TarStream(io.RawIOBase):
    """A readable, non-seekable tar stream of ``root``, produced lazily (file data is read on demand)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self._root = root
        self._pieces = self._generate()
        self._buffer = memoryview(b"")
        self._file: io.BufferedReader | None = None
        self._file_left = 0
        self._padding = 0
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def _generate(self) -> Iterator[tuple[bytes, str | None, int]]:
        """(header bytes, path of the content to follow or None, content size) per entry, then the end."""
        for rel in tree_paths(self._root):
            try:
                info = tar_header(self._root, rel)
            except FileNotFoundError:  # removed while we walk the live volume
                continue
            if info is None:
                continue
            header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            content = os.path.join(self._root, rel) if info.type == tarfile.REGTYPE else None
            yield header, content, info.size
        yield b"\0" * (2 * BLOCK), None, 0

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(target).cast("B")
        while True:
            if self._buffer:
                n = min(len(out), len(self._buffer))
                out[:n] = self._buffer[:n]
                self._buffer = self._buffer[n:]
                self.bytes_read += n
                return n
            if self._file_left:
                return self._read_file(out)
            if self._padding:
                self._buffer, self._padding = memoryview(b"\0" * self._padding), 0
                continue
            try:
                header, content, size = next(self._pieces)
            except StopIteration:
                return 0
            self._buffer = memoryview(header)
            if content is not None and size:
                self._open_content(content, size)

    def _open_content(self, path: str, size: int) -> None:
        self._file_left = size
        self._padding = -size % BLOCK
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - closed when its data is consumed
        except FileNotFoundError:
            self._file = None  # vanished after its header was taken: zeros keep the stream valid

    def _read_file(self, out: memoryview) -> int:
        want = min(len(out), self._file_left)
        n = self._file.readinto(out[:want]) if self._file is not None else 0
        if not n:  # the file shrank under us: fill the announced size with zeros
            out[:want] = b"\0" * want
            n = want
        self._file_left -= n
        if not self._file_left and self._file is not None:
            self._file.close()
            self._file = None
        self.bytes_read += n
        return n

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def tar_bytes(root: Path) -> bytes:
    """The whole stream in memory (tests and small trees)."""
    with TarStream(root) as stream:
        return stream.read()


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def extract(stream: BinaryIO, dest: Path) -> None:
    """Extract a tar stream into ``dest`` refusing every member that would escape it.

    Guards: absolute names and ``..`` components are refused; a member's parent must resolve (symlinks
    followed) inside ``dest``, so nothing is written through a symlink that points elsewhere; an existing
    non-directory at a member's path is replaced, never written through. Symlinks themselves are data and
    keep their targets (absolute targets are normal inside containers). Owners are restored when the
    process may (root), modes and mtimes always.
    """
    root = os.path.realpath(dest)
    os.makedirs(root, exist_ok=True)
    dirs: list[tarfile.TarInfo] = []
    with tarfile.open(fileobj=stream, mode="r|", bufsize=READ_SIZE) as archive:
        for member in archive:
            name = member.name.rstrip("/")
            parts = name.split("/")
            if not name or name.startswith("/") or ".." in parts:
                raise UnsafeArchiveError(f"refusing archive member {member.name!r}: outside the restore root")
            target = os.path.join(root, *parts)
            parent = os.path.realpath(os.path.dirname(target))
            if not _inside(root, parent):
                raise UnsafeArchiveError(f"refusing archive member {member.name!r}: its parent escapes the root")
            if member.isdir():
                if os.path.islink(target):
                    os.unlink(target)
                os.makedirs(target, exist_ok=True)
                dirs.append(member)
                continue
            if not (member.isreg() or member.issym()):
                continue
            if os.path.lexists(target):
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
            if member.issym():
                os.symlink(member.linkname, target)
                _chown(target, member, follow=False)
                os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
                continue
            source = archive.extractfile(member)
            assert source is not None
            with open(target, "wb") as out:
                shutil.copyfileobj(source, out, READ_SIZE)
            _chown(target, member, follow=True)
            os.chmod(target, member.mode)
            os.utime(target, (member.mtime, member.mtime))
    # Directory attributes last: writing their children would move their mtimes again.
    for member in reversed(dirs):
        target = os.path.join(root, *member.name.rstrip("/").split("/"))
        _chown(target, member, follow=True)
        os.chmod(target, member.mode)
        os.utime(target, (member.mtime, member.mtime))


def _chown(path: str, member: tarfile.TarInfo, *, follow: bool) -> None:
    if os.geteuid() != 0:
        return
    try:
        os.chown(path, member.uid, member.gid, follow_symlinks=follow)
    except OSError:
        pass  # best effort (e.g. an id mapping that refuses the owner): the data matters more than the owner
