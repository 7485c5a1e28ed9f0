"""The Python base image of the docker runtime: a root filesystem made from an interpreter of this node.

The source builder installs a Python app's packages for one interpreter of the builder node (its absolute
path is the first line of the installed scripts, and the image config's label ``dev.zattera.python``). Every
node runs the platform on that same interpreter, so the docker runtime needs no registry image: it copies the
interpreter into a minimal root filesystem, exactly where the node has it:

* the interpreter and its standard library (without ``site-packages``, tests, Tk, IDLE, ``ensurepip``,
  ``lib2to3``, ``pydoc_data``, the static library and optimised bytecode), its pure-Python modules as one
  file, the interpreter's own ``python3XX.zip`` (:func:`stdlib_zip`), its extension modules and every shared
  library ``ldd`` lists for them (the loader too), ELF files stripped when ``strip`` is here. Small and few
  files on purpose: vfs storage copies the whole root filesystem, file by file, into every container;
* ``/bin/sh`` (the images' entrypoint and commands are shell lines; exec health checks);
* the node's CA bundle where OpenSSL looks for it, an ``/etc/passwd`` with ``root`` and ``nobody``, a
  world-writable ``/tmp``, and ``python``/``python3`` in ``/usr/local/bin``.

Paths keep the node's symlinks (``/lib`` → ``usr/lib`` on merged-``/usr`` systems); directories are
readable by every user (the container runs as ``nobody``, the interpreter may live under ``/root``). The
image is built once per daemon and tagged ``zattera/python:<version>-<path digest>``: an interpreter upgrade
or another interpreter path makes another tag.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

PYTHON_LABEL = "dev.zattera.python"
"""Image config label: the absolute path of the interpreter the app's packages were installed for."""
BASE_REPO = "zattera/python"
SKIPPED_STDLIB = frozenset(
    {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
)
SKIPPED_EXTENSIONS = ("_tkinter", "_test", "_ctypes_test", "_xx", "xx")
SHELL = "/bin/sh"
LOCAL_BIN = "/usr/local/bin"
PASSWD = b"root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"
_PROBE = (
    "import json, os, ssl, sys, sysconfig; p = ssl.get_default_verify_paths(); print(json.dumps({"
    "'version': sys.version.split()[0], 'stdlib': sysconfig.get_path('stdlib'),"
    "'platstdlib': sysconfig.get_path('platstdlib'), 'zip': [e for e in sys.path if e.endswith('.zip')][:1],"
    "'cache_tag': sys.implementation.cache_tag,"
    "'cafiles': [f for f in (p.cafile, p.openssl_cafile) if f]}))"
)
_LDD_PATH = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


class PythonBaseError(Exception):
    """The interpreter an image needs is not usable on this node."""


@dataclass(frozen=True)
class Interpreter:
    """What an interpreter of this node is made of, as it reports itself."""

    path: str
    version: str
    stdlib: tuple[str, ...]
    cafiles: tuple[str, ...]
    zip_path: str
    """Where the interpreter looks for its standard library as a zip archive first (``python3XX.zip``)."""
    cache_tag: str

    @property
    def tag(self) -> str:
        digest = hashlib.sha256(self.path.encode()).hexdigest()[:8]
        return f"{BASE_REPO}:{self.version}-{digest}"


def inspect_interpreter(path: str) -> Interpreter:
    """Ask the interpreter at ``path`` (absolute) where its standard library and CA bundle are."""
    if not os.path.isabs(path):
        raise PythonBaseError(f"python interpreter {path!r} is not an absolute path")
    try:
        out = subprocess.run([path, "-I", "-c", _PROBE], capture_output=True, check=True, timeout=30).stdout
        doc = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise PythonBaseError(f"python interpreter {path} is not usable on this node: {exc}") from exc
    return Interpreter(
        path=path,
        version=str(doc["version"]),
        stdlib=tuple(dict.fromkeys([str(doc["stdlib"]), str(doc["platstdlib"])])),
        cafiles=tuple(str(f) for f in doc["cafiles"]),
        zip_path=str(doc["zip"][0]) if doc["zip"] else "",
        cache_tag=str(doc["cache_tag"]),
    )


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


class _RootFs:
    """A tar of host paths at their own places, symlinks kept as symlinks."""

    def __init__(self, tar: tarfile.TarFile, scratch: str) -> None:
        self.tar = tar
        self._added: set[str] = set()
        self._strip = shutil.which("strip")
        self._scratch = scratch

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
        copy = os.path.join(self._scratch, str(len(self._added)))
        done = subprocess.run([self._strip, "--strip-unneeded", "-o", copy, path], capture_output=True, check=False)
        return copy if done.returncode == 0 else path

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.size, info.mode = len(data), mode
        self.tar.addfile(info, io.BytesIO(data))

    def add_dir(self, name: str, mode: int) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        self.tar.addfile(info)

    def add_symlink(self, name: str, target: str) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(info)


def _stdlib_files(root: str) -> list[str]:
    """The standard library's files worth shipping (see the module docstring)."""
    files: list[str] = []
    for current, dirs, names in os.walk(root):
        if current == root:
            dirs[:] = [d for d in dirs if d not in SKIPPED_STDLIB and not d.startswith("config-")]
        for name in names:
            if ".opt-" in name or (os.path.basename(current) == "lib-dynload" and name.startswith(SKIPPED_EXTENSIONS)):
                continue
            files.append(os.path.join(current, name))
    return files


def _unchecked(pyc: bytes) -> bytes:
    """Bytecode marked hash-based and unchecked (PEP 552): used as it is, whatever its source's time in the
    zip archive (zip times are local and of 2 s resolution)."""
    return pyc[:4] + (1).to_bytes(4, "little") + bytes(8) + pyc[16:]


def stdlib_zip(interpreter: Interpreter, files: list[str]) -> tuple[bytes, list[str]]:
    """The pure-Python modules of ``files`` as the interpreter's ``python3XX.zip`` (each source with its
    bytecode, so tracebacks still show stdlib lines), and the files that stay files (extension modules, data,
    ``os.py``: the landmark by which the interpreter finds its prefix)."""
    buffer = io.BytesIO()
    rest: list[str] = []
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for path in files:
            root = next(r for r in interpreter.stdlib if path.startswith(r + os.sep))
            relative = os.path.relpath(path, root)
            if not path.endswith(".py") or relative == "os.py":
                if not (path.endswith(".pyc") and "__pycache__" in relative):
                    rest.append(path)
                if relative != "os.py":
                    continue
            archive.writestr(_entry(relative), Path(path).read_bytes())
            directory, name = os.path.split(path)
            cached = os.path.join(directory, "__pycache__", f"{name[:-3]}.{interpreter.cache_tag}.pyc")
            if os.path.isfile(cached):
                archive.writestr(_entry(relative[:-3] + ".pyc"), _unchecked(Path(cached).read_bytes()))
    return buffer.getvalue(), rest


def _entry(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def python_rootfs_tar(interpreter: Interpreter) -> bytes:
    """The base image's root filesystem for ``interpreter`` as a tar (see the module docstring)."""
    files = [f for root in interpreter.stdlib for f in _stdlib_files(root)]
    archive = b""
    if interpreter.zip_path and os.path.isdir(os.path.dirname(interpreter.zip_path)):
        archive, files = stdlib_zip(interpreter, files)
    binaries = [interpreter.path, SHELL, *(f for f in files if f.endswith(".so"))]
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory() as scratch, tarfile.open(fileobj=buffer, mode="w") as tar:
        rootfs = _RootFs(tar, scratch)
        for path in [*binaries, *files, *shared_libraries(binaries), *interpreter.cafiles]:
            if os.path.lexists(path):
                rootfs.add(path)
        if archive:
            directory, name = os.path.split(interpreter.zip_path)
            rootfs.add(directory)
            rootfs.add_file(os.path.join(os.path.realpath(directory), name), archive)
        rootfs.add_dir("tmp", 0o1777)
        rootfs.add_dir("proc", 0o755)
        rootfs.add_dir("sys", 0o755)
        rootfs.add_file("etc/passwd", PASSWD)
        if os.path.isdir(LOCAL_BIN):  # Debian has it: its symlinks say where it really is
            rootfs.add(LOCAL_BIN)
            for name in ("python", "python3"):
                if interpreter.path != os.path.join(LOCAL_BIN, name):
                    rootfs.add_symlink(os.path.join(os.path.realpath(LOCAL_BIN), name), interpreter.path)
    return buffer.getvalue()


def python_of(labels: dict[str, str]) -> str:
    """The interpreter an image config's labels say it needs ("" = none)."""
    return labels.get(PYTHON_LABEL, "")


def tar_size(data: bytes) -> int:
    """The bytes the files of a tar hold (what each container's copy of the root filesystem costs)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return sum(m.size for m in tar.getmembers() if m.isfile())


def main() -> None:
    """``python -m services.agent.pythonbase [interpreter]``: the root filesystem's size (PERFORMANCE.md)."""
    interpreter = inspect_interpreter(sys.argv[1] if len(sys.argv) > 1 else os.path.realpath(sys.executable))
    data = python_rootfs_tar(interpreter)
    print(f"{interpreter.tag}: {tar_size(data) / 1e6:.1f} MB of files, tar {len(data) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
