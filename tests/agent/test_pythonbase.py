"""The Python base image's root filesystem, made from this node's interpreter (no daemon needed: the docker
runtime running a Flask app on it is in test_stack_builds.py)."""

from __future__ import annotations

import io
import os
import re
import sys
import tarfile
import zipfile

import pytest

from services.agent.hostbase import shared_libraries
from services.agent.pythonbase import PythonBaseError, inspect_interpreter, python_rootfs_tar

NODE_PYTHON = os.path.realpath(sys.executable)


@pytest.fixture(scope="module")
def rootfs_tar() -> bytes:
    return python_rootfs_tar(inspect_interpreter(NODE_PYTHON))


@pytest.fixture(scope="module")
def rootfs(rootfs_tar: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(rootfs_tar)) as tar:
        return {"/" + m.name: m for m in tar.getmembers()}


def resolve(rootfs: dict[str, tarfile.TarInfo], path: str) -> tarfile.TarInfo:
    """Follow the image's own symlinks (components included) to the entry ``path`` names in the image."""
    current = "/"
    parts = [p for p in path.split("/") if p]
    for _ in range(100):
        if not parts:
            return rootfs[current]
        current = os.path.normpath(os.path.join(current, parts.pop(0)))
        entry = rootfs[current]  # KeyError: missing from the image
        if entry.issym():
            parts = [p for p in entry.linkname.split("/") if p] + parts
            current = "/" if entry.linkname.startswith("/") else os.path.dirname(current)
    raise AssertionError(f"symlink loop at {path}")


def test_the_interpreter_its_libraries_a_shell_and_certificates_are_where_the_node_has_them(
    rootfs: dict[str, tarfile.TarInfo], rootfs_tar: bytes
) -> None:
    interpreter = inspect_interpreter(NODE_PYTHON)
    assert resolve(rootfs, NODE_PYTHON).isfile()
    assert resolve(rootfs, "/bin/sh").isfile()
    assert resolve(rootfs, "/usr/local/bin/python3").isfile()
    for library in shared_libraries([NODE_PYTHON, "/bin/sh"]):  # the loader, libc and the like
        assert resolve(rootfs, library).isfile(), library
    assert resolve(rootfs, os.path.join(interpreter.stdlib[0], "os.py")).isfile()  # the prefix's landmark
    assert any(resolve(rootfs, f).isfile() for f in interpreter.cafiles if os.path.exists(f))
    assert rootfs["/tmp"].mode == 0o1777
    with tarfile.open(fileobj=io.BytesIO(rootfs_tar)) as tar:
        passwd = tar.extractfile("etc/passwd")
        assert passwd is not None and b"nobody:x:65534:65534" in passwd.read()


def test_pure_python_modules_are_one_zip_of_sources_and_unchecked_bytecode(
    rootfs: dict[str, tarfile.TarInfo], rootfs_tar: bytes
) -> None:
    """One file instead of thousands (vfs copies each container's root filesystem file by file)."""
    interpreter = inspect_interpreter(NODE_PYTHON)
    with tarfile.open(fileobj=io.BytesIO(rootfs_tar)) as tar:
        member = tar.extractfile(resolve(rootfs, interpreter.zip_path))
        assert member is not None
        archive = zipfile.ZipFile(io.BytesIO(member.read()))
    names = set(archive.namelist())
    assert {"json/__init__.py", "json/__init__.pyc", "encodings/utf_8.py"} <= names
    assert int.from_bytes(archive.read("json/__init__.pyc")[4:8], "little") == 1  # hash-based, unchecked
    sources = {name for name in rootfs if name.endswith(".py") and name.startswith(interpreter.stdlib[0])}
    assert sources == {os.path.join(interpreter.stdlib[0], "os.py")}


def test_what_an_app_does_not_need_is_left_out_and_everything_is_readable_by_nobody(
    rootfs: dict[str, tarfile.TarInfo],
) -> None:
    stdlib = inspect_interpreter(NODE_PYTHON).stdlib[0]
    for left_out in ("site-packages", "test", "tkinter", "idlelib", "ensurepip", "__pycache__"):
        assert not any(name.startswith(f"{stdlib}/{left_out}/") for name in rootfs), left_out
    assert all(m.mode & 0o005 == 0o005 for m in rootfs.values() if m.isdir())
    assert all(m.mode & 0o004 for m in rootfs.values() if m.isfile())


def test_an_interpreter_this_node_lacks_is_named() -> None:
    with pytest.raises(PythonBaseError, match=re.escape("/opt/no-such/python3.99 is not usable on this node")):
        inspect_interpreter("/opt/no-such/python3.99")
    with pytest.raises(PythonBaseError, match="'python3' is not an absolute path"):
        inspect_interpreter("python3")


def test_the_tag_names_the_version_and_the_interpreter_path() -> None:
    interpreter = inspect_interpreter(NODE_PYTHON)
    version = ".".join(str(n) for n in sys.version_info[:3])
    assert interpreter.tag.startswith(f"zattera/python:{version}-")
