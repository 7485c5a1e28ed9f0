"""The Python base image of the docker runtime: a root filesystem made from an interpreter of this node.

The source builder installs a Python app's packages for one interpreter of the builder node (its absolute
path is the first line of the installed scripts, and the image config's label ``dev.zattera.python``). Every
node runs the platform on that same interpreter, so the docker runtime needs no registry image: it copies the
interpreter into a minimal root filesystem, exactly where the node has it (``hostbase.py``'s machinery):

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

import io
import json
import os
import sys
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.agent.hostbase import (
    BaseImageError,
    RootFs,
    ask_program,
    base_tag,
    program_rootfs_tar,
    shared_libraries,
    tar_size,
)

PYTHON_LABEL = "dev.zattera.python"
"""Image config label: the absolute path of the interpreter the app's packages were installed for."""
SKIPPED_STDLIB = frozenset(
    {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
)
SKIPPED_EXTENSIONS = ("_tkinter", "_test", "_ctypes_test", "_xx", "xx")
_PROBE = (
    "import json, os, ssl, sys, sysconfig; p = ssl.get_default_verify_paths(); print(json.dumps({"
    "'version': sys.version.split()[0], 'stdlib': sysconfig.get_path('stdlib'),"
    "'platstdlib': sysconfig.get_path('platstdlib'), 'zip': [e for e in sys.path if e.endswith('.zip')][:1],"
    "'cache_tag': sys.implementation.cache_tag,"
    "'cafiles': [f for f in (p.cafile, p.openssl_cafile) if f]}))"
)


class PythonBaseError(BaseImageError):
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
        return base_tag("python", self.version, self.path)


def inspect_interpreter(path: str) -> Interpreter:
    """Ask the interpreter at ``path`` (absolute) where its standard library and CA bundle are."""
    doc = ask_program("python interpreter", path, ["-I", "-c", _PROBE], json.loads, PythonBaseError)
    return Interpreter(
        path=path,
        version=str(doc["version"]),
        stdlib=tuple(dict.fromkeys([str(doc["stdlib"]), str(doc["platstdlib"])])),
        cafiles=tuple(str(f) for f in doc["cafiles"]),
        zip_path=str(doc["zip"][0]) if doc["zip"] else "",
        cache_tag=str(doc["cache_tag"]),
    )


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


def python_rootfs_tar(
    interpreter: Interpreter,
    packages: Mapping[str, str] | None = None,
    extra: Callable[[RootFs], None] | None = None,
) -> bytes:
    """The base image's root filesystem for ``interpreter`` as a tar (see the module docstring), with
    ``packages`` (image path → file of this node: installed packages), the libraries their extension
    modules load, and what ``extra`` adds."""
    packages = packages or {}
    files = [f for root in interpreter.stdlib for f in _stdlib_files(root)]
    archive = b""
    if interpreter.zip_path and os.path.isdir(os.path.dirname(interpreter.zip_path)):
        archive, files = stdlib_zip(interpreter, files)
    package_roots = tuple({os.path.dirname(source) for source in packages.values()})
    package_libraries = [
        library
        for library in shared_libraries([source for source in packages.values() if ".so" in os.path.basename(source)])
        if not library.startswith(package_roots)  # a wheel's own bundled libraries come with its files
    ]

    def add_zip_and_packages(rootfs: RootFs) -> None:
        if archive:
            directory, name = os.path.split(interpreter.zip_path)
            rootfs.add(directory)
            rootfs.add_file(os.path.join(os.path.realpath(directory), name), archive)
        for name, source in packages.items():
            rootfs.add_copy(source, name)
        if extra is not None:
            extra(rootfs)

    return program_rootfs_tar(
        interpreter.path,
        ["python", "python3"],
        files=[*files, *package_libraries],
        loaded=[f for f in files if f.endswith(".so")],
        cafiles=interpreter.cafiles,
        extra=add_zip_and_packages,
    )


def python_of(labels: Mapping[str, str]) -> str:
    """The interpreter an image config's labels say it needs ("" = none)."""
    return labels.get(PYTHON_LABEL, "")


def main() -> None:
    """``python -m services.agent.pythonbase [interpreter]``: the root filesystem's size (PERFORMANCE.md)."""
    interpreter = inspect_interpreter(sys.argv[1] if len(sys.argv) > 1 else os.path.realpath(sys.executable))
    data = python_rootfs_tar(interpreter)
    print(f"{interpreter.tag}: {tar_size(data) / 1e6:.1f} MB of files, tar {len(data) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
