"""The Node base image's root filesystem, made from this node's ``node`` (no daemon needed: the docker runtime
running examples/express on it is in test_stack_builds.py). The shared machinery is also checked through the
Python base (test_pythonbase.py)."""

from __future__ import annotations

import io
import os
import re
import shutil
import tarfile

import pytest

from services.agent.hostbase import (
    BaseImageError,
    inspect_node,
    node_cafiles,
    node_rootfs_tar,
    shared_libraries,
)
from tests.agent.test_pythonbase import resolve

NODE = os.path.realpath(shutil.which("node") or "/usr/bin/node")


@pytest.fixture(scope="module")
def rootfs_tar() -> bytes:
    return node_rootfs_tar(inspect_node(NODE))


@pytest.fixture(scope="module")
def rootfs(rootfs_tar: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(rootfs_tar)) as tar:
        return {"/" + m.name: m for m in tar.getmembers()}


def test_node_its_libraries_a_shell_and_certificates_are_where_the_node_has_them(
    rootfs: dict[str, tarfile.TarInfo], rootfs_tar: bytes
) -> None:
    assert resolve(rootfs, NODE).isfile()
    assert resolve(rootfs, "/bin/sh").isfile()
    assert resolve(rootfs, "/usr/local/bin/node").isfile()
    for library in shared_libraries([NODE, "/bin/sh"]):  # the loader, libc, libstdc++ and the like
        assert resolve(rootfs, library).isfile(), library
    assert any(resolve(rootfs, f).isfile() for f in node_cafiles() if os.path.exists(f))
    assert rootfs["/tmp"].mode == 0o1777
    with tarfile.open(fileobj=io.BytesIO(rootfs_tar)) as tar:
        passwd = tar.extractfile("etc/passwd")
        assert passwd is not None and b"nobody:x:65534:65534" in passwd.read()


def test_only_node_itself_no_npm_and_everything_readable_by_nobody(rootfs: dict[str, tarfile.TarInfo]) -> None:
    """A start script is resolved at build time, so npm (thousands of files vfs would copy) stays out."""
    assert not any("node_modules" in name or name.endswith("/npm") for name in rootfs)
    assert len([m for m in rootfs.values() if m.isfile()]) < 30
    assert all(m.mode & 0o005 == 0o005 for m in rootfs.values() if m.isdir())
    assert all(m.mode & 0o004 for m in rootfs.values() if m.isfile())


def test_the_tag_names_the_version_and_the_path() -> None:
    node = inspect_node(NODE)
    assert re.fullmatch(r"zattera/node:\d+\.\d+\.\d+-[0-9a-f]{8}", node.tag)


def test_a_node_this_machine_lacks_is_named() -> None:
    with pytest.raises(BaseImageError, match=re.escape("node /opt/no-such/node is not usable on this node")):
        inspect_node("/opt/no-such/node")
    with pytest.raises(BaseImageError, match="node 'node' is not an absolute path"):
        inspect_node("node")
