"""Base images of the docker runtime made from a program of this node and the libraries it loads.

A source-built image carries only the app and its dependencies; the program that runs it (the Python
interpreter its packages were installed for, the ``node`` binary its modules were installed with) is named by
an image config label, at its absolute path. Every node runs the platform with the same programs, so the
docker runtime needs no registry image: it copies the program into a minimal root filesystem, exactly where
the node has it, with

* every shared library ``ldd`` lists for it (the loader too), ELF files stripped when ``strip`` is here
  (small and few files on purpose: vfs storage copies the whole root filesystem, file by file, into every
  container);
* ``/bin/sh`` (the images' entrypoint and commands are shell lines; exec health checks);
* the node's CA bundle where OpenSSL looks for it, an ``/etc/passwd`` with ``root`` and ``nobody``, a
  world-writable ``/tmp``, and the program's names in ``/usr/local/bin``.

Paths keep the node's symlinks (``/lib`` → ``usr/lib`` on merged-``/usr`` systems); directories are
readable by every user (the container runs as ``nobody``, the program may live under ``/root``). A base is
tagged ``zattera/<program>:<version>-<path digest>``: an upgrade or another path makes another tag.

This module is the Node base (label ``dev.zattera.nodejs``: :func:`inspect_node`, :func:`node_rootfs_tar`), the
node's generic base (``ZATTERA_AGENT_DOCKER_BASE_IMAGE``, for images that name no program: :func:`shell_rootfs_tar`)
and the machinery the Python base (``pythonbase.py``: the standard library as one zip on top) shares.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from shared.errors import ZatteraError

T = TypeVar("T")

NODE_LABEL = "dev.zattera.nodejs"
"""Image config label: the absolute path of the ``node`` binary the app's modules were installed with (not
``dev.zattera.node``: containers carry that one, with the id of the node running them)."""
SHELL = "/bin/sh"
LOCAL_BIN = "/usr/local/bin"
PASSWD = b"root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"
_LDD_PATH = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


class BaseImageError(ZatteraError):
    """The program an image needs is not usable on this node."""


def base_tag(program: str, version: str, path: str) -> str:
    digest = hashlib.sha256(path.encode()).hexdigest()[:8]
    return f"zattera/{program}:{version}-{digest}"


def shared_libraries(binaries: list[str]) -> list[str]:
    """Every library (and the loader) ``ldd`` resolves for ``binaries``."""
    if not binaries:
        return []
    result = subprocess.run(["ldd", *binaries], capture_output=True, text=True, check=False, timeout=60)
    found: dict[str, None] = {}
    for line in result.stdout.splitlines():
        match = _LDD_PATH.search(line)
        if match and not line.rstrip().endswith(":"):
            found[match.group(1)] = None
    return list(found)


def node_cafiles() -> list[str]:
    """Where this node's OpenSSL looks for its CA bundle (the platform's Python links the same OpenSSL)."""
    paths = ssl.get_default_verify_paths()
    return [f for f in (paths.cafile, paths.openssl_cafile) if f]


class RootFs:
    """A tar of host paths at their own places, symlinks kept as symlinks."""

    def __init__(self, tar: tarfile.TarFile, scratch: str) -> None:
        self.tar = tar
        self._added: set[str] = set()
        self._strip = shutil.which("strip")
        self._scratch = scratch
        self._copies = itertools.count()
        self._made_dirs: set[str] = set()

    def add(self, path: str) -> None:
        """``path``, its parent directories and, for a symlink, what it points at."""
        path = os.path.normpath(path)
        if path == "/" or path in self._added:
            return
        self._added.add(path)
        parent, name = os.path.split(path)
        self.add(parent)
        entry = os.path.join(os.path.realpath(parent), name)
        if entry != path:
            self.add(entry)  # written at its real place; the symlinked parents are in the tar
            return
        if not os.path.lexists(entry):  # a dangling symlink's target: the link alone is kept
            return
        st = os.lstat(entry)
        info = tarfile.TarInfo(entry.lstrip("/"))
        info.mtime = int(st.st_mtime)  # a module's bytecode is used only while its source has the recorded time
        if stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(entry)
            self.tar.addfile(info)
            self.add(os.path.join(parent, info.linkname))
        elif stat.S_ISDIR(st.st_mode):
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            self.tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            info.mode = 0o755 if st.st_mode & 0o111 else 0o644
            source = self._stripped(entry)
            info.size = os.path.getsize(source)
            with open(source, "rb") as fh:
                self.tar.addfile(info, fh)

    def _stripped(self, path: str) -> str:
        """A copy of an ELF file without its symbols when binutils' ``strip`` is here (an interpreter built
        from source keeps them: tens of MB every container would copy), else the file itself."""
        with open(path, "rb") as fh:
            if not self._strip or fh.read(4) != b"\x7fELF":
                return path
        copy = os.path.join(self._scratch, str(next(self._copies)))
        done = subprocess.run([self._strip, "--strip-unneeded", "-o", copy, path], capture_output=True, check=False)
        return copy if done.returncode == 0 else path

    def add_copy(self, source: str, name: str) -> None:
        """The host file ``source`` written at ``name`` (stripped like :meth:`add`'s), with its mode and time,
        and its parent directories (readable by all: the daemon would make missing ones private)."""
        self._parents(name)
        st = os.stat(source)
        info = tarfile.TarInfo(name.lstrip("/"))
        info.mtime, info.mode = int(st.st_mtime), 0o755 if st.st_mode & 0o111 else 0o644
        stripped = self._stripped(source)
        info.size = os.path.getsize(stripped)
        with open(stripped, "rb") as fh:
            self.tar.addfile(info, fh)

    def _parents(self, name: str) -> None:
        parent = os.path.dirname(name.strip("/"))
        if parent and parent not in self._made_dirs:
            self._parents(parent)
            self._made_dirs.add(parent)
            self.add_dir(parent, 0o755)

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.size, info.mode = len(data), mode
        self.tar.addfile(info, io.BytesIO(data))

    def add_dir(self, name: str, mode: int, owner: int = 0) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, owner, owner
        self.tar.addfile(info)

    def add_symlink(self, name: str, target: str) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(info)


def program_rootfs_tar(
    program: str,
    names: Iterable[str],
    *,
    files: Iterable[str] = (),
    loaded: Iterable[str] = (),
    cafiles: Iterable[str] = (),
    extra: Callable[[RootFs], None] | None = None,
) -> bytes:
    """A root filesystem for ``program`` (see the module docstring) as a tar: ``names`` link to it in
    ``/usr/local/bin``; ``files`` are copied too, and the libraries of ``loaded`` (extension modules) with
    them; ``extra`` adds what is the program's own (the Python base's standard library zip)."""
    binaries = [program, SHELL, *loaded]
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory() as scratch, tarfile.open(fileobj=buffer, mode="w") as tar:
        rootfs = RootFs(tar, scratch)
        for path in [*binaries, *files, *shared_libraries(binaries), *cafiles]:
            if os.path.lexists(path):
                rootfs.add(path)
        if extra is not None:
            extra(rootfs)
        rootfs.add_dir("tmp", 0o1777)
        rootfs.add_dir("proc", 0o755)
        rootfs.add_dir("sys", 0o755)
        rootfs.add_file("etc/passwd", PASSWD)
        if os.path.isdir(LOCAL_BIN):  # Debian has it: its symlinks say where it really is
            rootfs.add(LOCAL_BIN)
            for name in names:
                if program != os.path.join(LOCAL_BIN, name):
                    rootfs.add_symlink(os.path.join(os.path.realpath(LOCAL_BIN), name), program)
    return buffer.getvalue()


@dataclass(frozen=True)
class NodeProgram:
    """A ``node`` binary of this node."""

    path: str
    version: str
    """``node --version`` without its ``v``."""

    @property
    def tag(self) -> str:
        return base_tag("node", self.version, self.path)


def ask_program(
    what: str, path: str, args: Sequence[str], read: Callable[[str], T], error: type[BaseImageError] = BaseImageError
) -> T:
    """What the program ``what`` at ``path`` (absolute) prints when run with ``args``, as ``read`` makes of
    it; ``error`` when ``path`` is not absolute, the program fails or ``read`` refuses its output."""
    if not os.path.isabs(path):
        raise error(f"{what} {path!r} is not an absolute path")
    try:
        return read(subprocess.run([path, *args], capture_output=True, text=True, check=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise error(f"{what} {path} is not usable on this node: {exc}") from exc


def inspect_node(path: str) -> NodeProgram:
    """Ask the ``node`` at ``path`` (absolute) its version."""
    return NodeProgram(
        path=path, version=ask_program("node", path, ["--version"], lambda out: out.strip().removeprefix("v"))
    )


def node_rootfs_tar(node: NodeProgram) -> bytes:
    """The Node base image's root filesystem: ``node`` (no ``npm``: a ``start`` script is resolved at build
    time, docs/builds.md), its libraries, the shell and the CA bundle."""
    return program_rootfs_tar(node.path, ["node"], cafiles=node_cafiles())


def shell_rootfs_tar() -> bytes:
    """The node's generic base image: what images that name no program run on (``exec:`` commands, sources
    packed as they are): the node's ``/bin/sh`` with its libraries and, when the node has ``busybox``, busybox
    with its applets in ``/usr/local/bin`` (``mkdir``, ``sleep``, ``httpd``, ``wget`` …); the CA bundle,
    ``/etc/passwd``, ``/tmp``. A node without busybox gets the shell alone."""
    found = shutil.which("busybox")
    if found is None:
        return program_rootfs_tar(SHELL, [], cafiles=node_cafiles())
    busybox = os.path.realpath(found)
    listed = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=False, timeout=30).stdout
    applets = [name for name in listed.split() if name and "/" not in name]
    return program_rootfs_tar(busybox, applets, cafiles=node_cafiles())


def node_of(labels: Mapping[str, str]) -> str:
    """The ``node`` an image config's labels say it needs ("" = none)."""
    return labels.get(NODE_LABEL, "")


def tar_size(data: bytes) -> int:
    """The bytes the files of a tar hold (what each container's copy of the root filesystem costs)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return sum(m.size for m in tar.getmembers() if m.isfile())


def main() -> None:
    """``python -m services.agent.hostbase [NODE]``: the Node base's size (PERFORMANCE.md)."""
    node = inspect_node(sys.argv[1] if len(sys.argv) > 1 else os.path.realpath(shutil.which("node") or "node"))
    data = node_rootfs_tar(node)
    print(f"{node.tag}: {tar_size(data) / 1e6:.1f} MB of files, tar {len(data) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
